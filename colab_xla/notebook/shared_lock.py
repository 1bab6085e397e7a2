"""The lock replicas share (``with lock: print(...)``): a Manager lock, whose proxy pickles
and works across processes, from one manager process kept for the kernel's life
(starting one costs ~30 ms, a lock ~1 ms).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.managers
import os
import signal
from typing import Optional

from ..wire import lifetime


def new_lock():
    """A lock for one run's replicas."""
    return manager().Lock()


_manager: Optional[multiprocessing.managers.SyncManager] = None


def manager() -> multiprocessing.managers.SyncManager:
    """A Manager kept for the kernel's life: starting one costs ~30 ms, a lock ~1 ms."""
    global _manager
    if _manager is None or not _manager._process.is_alive():
        _manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("fork"))
        _manager.start(_manager_process_init, (os.getpid(),))
    return _manager


def _manager_process_init(parent_pid: int) -> None:
    # The notebook's Interrupt reaches its whole process group; the manager must outlive it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lifetime.die_with_parent(parent_pid)


def shutdown() -> None:
    """Stop the lock manager (on ``%unload_ext colab_xla``)."""
    global _manager
    if _manager is not None:
        with contextlib.suppress(Exception):
            _manager.shutdown()
        _manager = None
