"""When a run is cut, and why: :class:`Deadlines`, the fail-fast and ``--timeout`` policy.

A run is cut (its replicas stopped, see :class:`colab_xla.notebook.replicas.Replicas`) on
``--timeout``'s deadline, :data:`FAIL_FAST_SECONDS` after the first replica failed or its
process died, when a replica has not started the cell within its target's bound (a
session's replica that does not take the cell: ``"unstarted"``), or on an Interrupt (the
read loop hears of that from :mod:`colab_xla.notebook.interrupts` and cuts for
``"interrupted"``). Once the run is cut,
a replica's end is late and does not count: it is settled as stopped, with an error saying
why (:meth:`Deadlines.stopped`). Everything here is a function of the times and states it
is given; the :class:`colab_xla.notebook.supervisor.Supervisor` reads the clock, as does a
cell's run on every host of a cluster (:mod:`colab_xla.notebook.targets.cluster_run`: the
same policy, its hosts told to stop their replicas).

>>> d = Deadlines(timeout=None, now=100.0)
>>> d.failed(2, now=101.0); d.passed(103.5), d.passed(104.0), d.first_failed
(None, 'failed', 2)
>>> d = Deadlines(timeout=None, now=100.0, start=30.0, replicas=range(2))
>>> d.started(0); d.passed(129.0), d.passed(130.0), d.unstarted
(None, 'unstarted', [1])
"""

from __future__ import annotations

from typing import Iterable, List, Mapping, Optional

from . import endings
from .outcome import ReplicaOutcome
from ..wire import values
from ..wire.reports import ReplicaError

# Once a replica has failed, how long the others may go on before the run is stopped:
# they are usually blocked in a collective waiting for it and would wait forever
# (pytorch/xla#7974).
FAIL_FAST_SECONDS = 3.0


class Deadlines:
    """One run's deadlines (monotonic seconds) and why it was cut (``stop``: ``"timeout"``,
    ``"failed"``, ``"interrupted"``, or None while it goes on)."""

    def __init__(self, timeout: Optional[float], now: float, start: Optional[float] = None,
                 replicas: Iterable[int] = ()):
        self.timeout = timeout
        self.timeout_at: Optional[float] = now + timeout if timeout else None
        self.fail_at: Optional[float] = None  # set by the first failure
        self.first_failed: Optional[int] = None
        self.stop: Optional[str] = None  # why the run was cut
        # Every one of the ``replicas`` (ordinals) must have started the cell within
        # ``start`` seconds (None: no bound; none given: not known here).
        self.start = start
        self._unstarted = set(replicas) if start else set()
        self.start_at: Optional[float] = now + start if self._unstarted else None

    @property
    def unstarted(self) -> List[int]:
        """The replicas that have not started the cell (while the bound holds)."""
        return sorted(self._unstarted)

    def started(self, ordinal: int) -> None:
        """Replica ``ordinal`` started the cell: the last one lifts the start bound. (Once
        the run is cut, a start is late: the replicas that had not started stay named.)"""
        if self.stop:
            return
        self._unstarted.discard(ordinal)
        if not self._unstarted:
            self.start_at = None

    def failed(self, ordinal: int, now: float) -> None:
        """Replica ``ordinal`` failed (or its process died before its report) at ``now``:
        the first one starts the others' :data:`FAIL_FAST_SECONDS`."""
        if self.fail_at is None:
            self.first_failed = ordinal
            self.fail_at = now + FAIL_FAST_SECONDS

    def passed(self, now: float) -> Optional[str]:
        """The deadline that has passed at ``now``, as the reason to cut the run
        (``"timeout"`` before ``"failed"`` before ``"unstarted"``), or None."""
        for reason, at in (("timeout", self.timeout_at), ("failed", self.fail_at),
                           ("unstarted", self.start_at)):
            if at is not None and now >= at:
                return reason
        return None

    def in_time(self, end_payload: bytes) -> bool:
        """Whether a replica's end (an END frame's payload: when it was sent) counts: not
        once the run was cut, nor if it was sent after ``--timeout``'s deadline (read
        before the loop saw the deadline pass, forks holding it up): then the run is over
        all the same, cut for ``"timeout"``."""
        if self.stop:
            return False
        ended = values.ended_at(end_payload)
        if self.timeout_at is not None and ended is not None and ended > self.timeout_at:
            self.stop = "timeout"
            return False
        return True

    def stopped(self, rep: ReplicaOutcome,
                replicas: Mapping[int, ReplicaOutcome]) -> ReplicaError:
        """The error of replica ``rep``, stopped when the run was cut (``replicas``: the
        outcome's, to name the first that failed)."""
        return endings.stopped(self.stop, rep, timeout=self.timeout, grace=FAIL_FAST_SECONDS,
                               first_failed=replicas.get(self.first_failed),
                               unstarted=self.unstarted, start=self.start)
