"""The notebook names a replica started by spawn or a forkserver receives.

A forked replica inherits every name of the notebook. A fresh interpreter (``spawn``) or a
child of the forkserver does not: it gets the names the cell mentions that the notebook
defines, serialized with cloudpickle, so functions and classes defined in the notebook
travel by value (and their instances come back as the notebook's own classes). Modules
travel by name and are imported again.

A name that cannot be serialized (an open file, a lock, the IPython shell) is reported by
name, type and reason before anything starts.

Example::

    >>> from colab_xla.wire.cell import Cell
    >>> ns = {"scale": 3, "unused": object(), "np": __import__("math")}
    >>> used_names(Cell("print(scale * index, np.pi)"), ns)
    ['np', 'scale']
    >>> sorted(unpack(pack(["np", "scale"], ns)))
    ['np', 'scale']
"""

from __future__ import annotations

import pickle
from typing import Dict, Iterable, List, Mapping, Tuple

import cloudpickle

from ..errors import PreflightError, Problem
from .cell import Cell

# Names every replica gets from colab_xla itself (see colab_xla.replica); get_ipython is
# what IPython's magic lines in the cell (``%time``, ``%env``) call.
REPLICA_NAMES = ("index", "device", "lock", "get_ipython")
SESSION = "session"  # the names go to a session's replicas (colab_xla.notebook.targets.session)


class UnsendableNames(PreflightError):
    """Names the cell uses that cannot be sent to a replica that does not fork."""

    def __init__(self, start_method: str, failures: List[Tuple[str, str, str]]):
        self.failures = failures
        listed = "; ".join(f"{name} ({kind}): {reason}" for name, kind, reason in failures)
        which = "this one" if len(failures) == 1 else "these"
        if start_method == SESSION:
            problem = Problem(
                "unsendable",
                f"the session's replicas get the notebook names a cell uses serialized with "
                f"cloudpickle, and {which} cannot be: {listed}.",
                "Create the object inside a session cell (the replicas keep it), or run this "
                "cell with --fresh (a one-off run, whose forked replicas inherit it).")
        else:
            problem = Problem(
                "unsendable",
                f"--start-method {start_method} starts replicas in fresh processes, which get "
                f"the notebook names the cell uses serialized with cloudpickle, and {which} "
                f"cannot be: {listed}.",
                "Create the object inside the cell, or use --start-method fork (the replicas "
                "then inherit it).")
        super().__init__(problem)


def used_names(cell: Cell, user_ns: Mapping) -> List[str]:
    """Names the cell mentions that the notebook defines (sorted)."""
    return sorted(n for n in cell.names if n in user_ns and n not in REPLICA_NAMES)


def pack(names: Iterable[str], user_ns: Mapping, start_method: str = "spawn") -> bytes:
    """Serialize ``names`` of ``user_ns`` together (objects they share stay shared), or
    raise :class:`UnsendableNames` naming each one that fails."""
    values = {name: user_ns[name] for name in names}
    try:
        return cloudpickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - find and report every culprit below
        pass
    failures = []
    for name, value in values.items():
        try:
            cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001
            failures.append((name, type(value).__name__, f"{type(exc).__name__}: {exc}"))
    if not failures:  # each alone pickles, together they do not (rare): say so
        failures.append((", ".join(values), "names", "they cannot be serialized together"))
    raise UnsendableNames(start_method, failures)


def unpack(data: bytes) -> Dict[str, object]:
    """In the replica: the names, loaded."""
    return pickle.loads(data)


def unloadable(exc: BaseException, where: str = "in the replica",
               importable: str = "by a fresh interpreter",
               way_out: str = ", or use --start-method fork") -> str:
    """What to say when :func:`unpack` raised ``exc`` ``where`` the names were loaded."""
    return (f"the notebook names the cell uses could not be loaded {where} "
            f"({type(exc).__name__}: {exc}). A module they need must be importable "
            f"{importable} (installed, or on sys.path); or define them in the cell{way_out}.")
