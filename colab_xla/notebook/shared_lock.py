"""The lock replicas share (``with lock: print(...)``): a Manager lock, whose proxy pickles
and works across processes, from one manager process kept for the kernel's life
(starting a manager costs far more than making a lock).

The manager listens on a socket in this notebook process's work directory, not in a
``pymp-*`` directory of its own in /tmp: the manager dies with the notebook's process
(``die_with_parent``), and when that is killed (a kernel restarted, shut down at once),
the next notebook process's sweep of the work directories removes the socket with the
rest (:func:`colab_xla.notebook.state.own_dir`); a ``pymp-*`` directory stayed for good.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.managers
import os
import signal
from typing import Optional

from . import state
from ..wire import lifetime


def new_lock():
    """A lock for one run's replicas."""
    return manager().Lock()


_manager: Optional[multiprocessing.managers.SyncManager] = None


def manager() -> multiprocessing.managers.SyncManager:
    """The Manager kept for the kernel's life (started on first use, again if it died)."""
    global _manager
    if _manager is None or not _manager._process.is_alive():
        _manager = multiprocessing.managers.SyncManager(
            address=_address(), ctx=multiprocessing.get_context("fork"))
        _manager.start(_manager_process_init, (os.getpid(),))
    return _manager


_started = itertools.count()


def _address() -> Optional[str]:
    """Where a new manager listens: in this process's work directory (see the module);
    None under a TMPDIR too long for a socket's path (multiprocessing then picks the
    address, in a pymp-* directory of its own)."""
    work, name = state.own_dir("work"), f"lock-{next(_started)}"
    return os.path.join(work, name) if state.fits_socket(work, name) else None


def _manager_process_init(parent_pid: int) -> None:
    # The notebook's Interrupt reaches its whole process group; the manager must outlive it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lifetime.die_with_parent(parent_pid)
    os.umask(0o077)  # (before the manager binds its socket: no one else's to connect to)


def shutdown() -> None:
    """Stop the lock manager (on ``%unload_ext colab_xla``)."""
    global _manager
    if _manager is not None:
        with contextlib.suppress(Exception):
            _manager.shutdown()
        _manager = None
