"""How a process started for a run ends with the notebook's process, or with its replica.

Both sides call these: a replica process, the forkserver and the lock manager arm
:func:`die_with_parent`; a replica adopts the orphans of what its cell started
(:func:`adopt_orphans`) and ends them with its run (:func:`end_descendants`). Only pids,
never names.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Make this replica process the parent of every orphan among its descendants (Linux).

    ``os.system('server &')`` or a double fork leaves a process whose parent has exited:
    it would go to init and out of reach. Adopted, it stays a descendant of the replica,
    which the run ends with everything else it started.
    """
    if sys.platform.startswith("linux"):
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end_descendants() -> None:
    """SIGKILL every process this one started, and their own (by pid, never by name).

    Called when the last replica of the process has finished its cell: a subprocess, a
    forked child or a DataLoader worker the cell left running must not outlive the run,
    however short it was (the notebook's own clean-up comes after this process has gone,
    when its orphans would no longer be found).
    """
    try:  # no child, no descendant (orphans come to this process: adopt_orphans)
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # (reaps nothing)
    except ChildProcessError:
        return  # the usual case, without psutil's pass over every process of the machine
    import psutil

    victims = psutil.Process().children(recursive=True)
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    psutil.wait_procs(victims, timeout=3)


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """SIGKILL this process when the notebook's process dies (Linux), so no replica
    outlives a kernel restart holding a TPU (``signum``: another signal, for a process
    that has its own clean-up to do first)."""
    if sys.platform.startswith("linux"):
        _LIBC.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
