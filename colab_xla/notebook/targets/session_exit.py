"""The end of the notebook's process: every session it started that is still up is stopped
first (:func:`stop_at_exit`), or the process would wait for their replicas for ever."""

from __future__ import annotations

import atexit
import importlib
import os
import threading
import weakref
from typing import Optional

_up: weakref.WeakSet = weakref.WeakSet()  # the sessions this process started
_exit_hook_pid: Optional[int] = None


def stop_at_exit(session) -> None:
    """Stop ``session`` when this process exits normally (a kernel shut down or restarted,
    a script's end), if it is still up.

    A replica runs until it is told to stop or its notebook's process is gone, and the
    interpreter's exit first waits for the replicas' processes: xmp.spawn's process pool
    (concurrent.futures joins it), the simulation's processes (multiprocessing joins its
    children). Without this the process never ended on its own: a kernel waited to be
    killed. The hook runs in ``threading``'s exit, before those joins (its hooks run last
    registered first, hence the import)."""
    global _exit_hook_pid
    _up.add(session)
    if _exit_hook_pid == os.getpid():
        return
    importlib.import_module("concurrent.futures.process")  # (registers its join of pools)
    register = getattr(threading, "_register_atexit", None)  # private, in 3.10-3.13
    if register is None:  # (were it gone: atexit still runs before multiprocessing's join)
        atexit.register(stop_sessions)
    else:
        register(stop_sessions)
    _exit_hook_pid = os.getpid()


def stop_sessions() -> None:
    """The hook: stop every session of this process that is up."""
    if os.getpid() != _exit_hook_pid:  # a child forked from this process, ending
        return
    for session in list(_up):
        if session.up:
            session.stop()
