"""What a replica sends back when its cell ends: its :class:`ReplicaReport` (value,
``--pull`` names, error, time) and its :class:`ReplicaError`, as plain data that pickles
across processes (written by the replica, read by the notebook: :mod:`.values`)."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

# What to do when a replica's value cannot travel to the notebook.
RETURN_PLAIN_DATA = ("Return plain data instead (numbers, strings, lists, dicts, CPU tensors, "
                     "a state_dict()).")


@dataclasses.dataclass(frozen=True)
class ReplicaError:
    """One replica's failure, as data that pickles across processes.

    ``kind`` says what went wrong: ``"exception"`` (the cell raised), ``"exit"``
    (``sys.exit`` with a non-zero status), ``"result"`` (the cell's value or a ``--pull``
    name could not be sent back or loaded), ``"names"`` (the notebook names sent to a
    replica that does not fork could not be loaded there), ``"died"`` (the replica's process
    ended without a report), ``"launch"`` (no replica started: see ``RunOutcome.launch_error``),
    ``"unsent"`` (a session's cell could not be sent to its replicas, which are still up),
    ``"interrupted"``, ``"timeout"`` or ``"stopped"`` (the run was cut while it ran: by
    Interrupt, ``--timeout``, or because another replica failed or did not start), or
    ``"unstarted"`` (the replica had not started the cell within its bound: a session's
    replica stuck between cells). ``traceback`` is the
    text to show, with frames of the cell shown as ``Cell In[N], line L``.
    """

    kind: str
    ename: str
    evalue: str
    traceback: str = ""
    where: str = ""  # what this replica last did when the run was cut (its last line...)
    # Where in the cell it was when the run was cut (colab_xla.wire.stacks.place): the
    # line, its source, the call it was in.
    place: str = ""

    def render(self) -> str:
        """The text a person reads: the traceback, or ``ename: evalue`` without one."""
        if self.traceback:
            return self.traceback.rstrip("\n")
        text = f"{self.ename}: {self.evalue}" if self.evalue else self.ename
        return "; ".join(filter(None, (text, self.place and f"at {self.place}", self.where)))


@dataclasses.dataclass
class ReplicaReport:
    """What a replica sends back when its cell ends (written by the replica)."""

    ordinal: int
    pid: int
    elapsed: float
    value: Optional[bytes] = None  # the cell's last expression, pickled (None: no value)
    value_repr: Optional[str] = None  # its repr, made in the replica
    error: Optional[ReplicaError] = None
    pulled: Dict[str, bytes] = dataclasses.field(default_factory=dict)  # --pull, pickled
