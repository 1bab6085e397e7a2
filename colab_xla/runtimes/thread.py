"""Which replica the calling thread runs.

On CPU (and TPU v2/v3) several replicas are threads of one process: whatever routes by
replica (output lines, notes, the in-memory rendezvous of CPU replicas) asks here.
``current.ordinal`` is the replica's ordinal in its own thread, None elsewhere. A thread
started from a replica's thread (or from a thread such a thread started) belongs to that
replica: :func:`replica` says which, in a process where :func:`claim_started_threads`
has run.
"""

import functools
import threading
from typing import Optional

_STARTER = "_colab_xla_replica"  # (on a Thread object: the replica that started it)


class _Current(threading.local):
    ordinal = None  # (a class default: reading it in a thread that set none is fast)
    # A session replica's last cell's exception, and the cell's file (for %xla_debug).
    failure = None


current = _Current()


def replica() -> Optional[int]:
    """The replica the calling thread runs, or whose thread started it; None for a thread
    no replica started (the process's own, or one started before
    :func:`claim_started_threads`)."""
    ordinal = current.ordinal
    if ordinal is None:
        ordinal = getattr(threading.current_thread(), _STARTER, None)
    return ordinal


def claim_started_threads() -> None:
    """From now on, a thread started in this process belongs to the replica of the
    thread that starts it (``threading.Thread.start`` notes it; once per process)."""
    start = threading.Thread.start
    if getattr(start, _STARTER, False):
        return

    @functools.wraps(start)
    def started(self, *args, **kwargs):
        try:
            setattr(self, _STARTER, replica())
        except AttributeError:  # (a subclass that takes no attributes: the process's)
            pass
        return start(self, *args, **kwargs)

    setattr(started, _STARTER, True)
    threading.Thread.start = started
