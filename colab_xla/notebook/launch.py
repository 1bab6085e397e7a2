"""How replica processes start: start method, launcher, one-replica debugging, forkserver.

* ``fork`` (the default) copies the notebook's process: the replicas inherit every name
  and start fastest.
* ``spawn`` starts fresh interpreters: safe whatever the notebook did (threads, CUDA),
  but each imports torch and torch_xla again, every run.
* ``forkserver`` forks replicas from a server process that colab_xla starts once per
  notebook process with torch and torch_xla already imported (:func:`warm_forkserver`):
  spawn's safety at fork's speed once it is warm (the three side by side: bench/results.md,
  "Start methods").

The launcher is ``xmp.spawn`` (``"xmp"``) or ``torch_xla.launch`` (``"launch"``), which
calls it. On CPU, xmp.spawn runs every replica as a thread of a single process whatever
the count; for the default simulation, one process per replica as on a TPU v4 or later
host (:mod:`colab_xla.runtimes.cpu_sim`), :func:`start` starts the processes itself, one
``multiprocessing`` process per replica with the same start method, each told its rank
the way xmp.spawn tells its own (``PJRT_LOCAL_PROCESS_RANK``/``COUNT``).

With ``debug_single``, one replica runs through
``torch_xla.launch(..., debug_single_process=True)``, which runs it in the calling
process: here that is a child process of its own, so the notebook's process still never
touches the XLA runtime.

Example::

    >>> Launch("forkserver").describe()
    'forkserver'
    >>> Launch("spawn", launcher="launch", debug_single=True).describe()
    'spawn, torch_xla.launch, one replica (debug_single_process)'
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.machinery
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple, Union

from . import state
from .. import runtimes
from ..errors import OptionError, SetupError
from ..replica import entry as replica_entry
from ..runtimes.base import meeting_place

# What replicas run (the launcher's entry, the notebook's one way into the replica side):
# a one-off run's cell, a session's cells; and what forked replicas inherit.
run_replica, serve_replica, inherit = replica_entry.main, replica_entry.serve, replica_entry.inherit

START_METHODS = ("fork", "spawn", "forkserver")
# How often the processes colab_xla starts itself are asked whether they ended (see
# _start_processes; their sentinels usually tell at once).
_EXIT_POLL_SECONDS = 0.5
LAUNCHERS = ("xmp", "launch")

# What the forkserver imports once, so that the replicas it forks start warm; first, what
# makes it die with the notebook's process; then torch_xla, and what its runtime preloads
# (the forkserver skips a module that fails to import); last, what the replicas would each
# find out after.
FORKSERVER_PRELOAD = ("colab_xla.replica.forkserver_init", "colab_xla.replica.entry",
                      "torch", "torch_xla", "torch_xla.runtime", "torch_xla.core.xla_model",
                      *runtimes.get("torch_xla").preloads,
                      *runtimes.get("torch_xla").simulation_preloads,
                      "colab_xla.replica.forkserver_ready")


@dataclass(frozen=True)
class Launch:
    """How to start the replicas of a run."""

    start_method: str = "fork"
    launcher: str = "xmp"
    debug_single: bool = False
    # The runtime (colab_xla.runtimes.Runtime), given as one or by name; None: the default.
    runtime: Union[runtimes.Runtime, str, None] = None
    devices_per_process: Optional[int] = None  # the JAX runtime's, on CPU

    def __post_init__(self):
        if self.start_method not in START_METHODS:
            raise OptionError(f"--start-method {self.start_method}: use one of "
                             f"{', '.join(START_METHODS)}.")
        if self.launcher not in LAUNCHERS:
            raise OptionError(f"--launcher {self.launcher}: use xmp (xmp.spawn) or launch "
                             "(torch_xla.launch).")
        object.__setattr__(self, "runtime", runtimes.get(self.runtime))  # (frozen)
        self.runtime.check_launch(self)  # the options that are another runtime's

    def describe(self) -> str:
        parts = [self.start_method]
        if self.launcher == "launch" or self.debug_single:
            parts.append("torch_xla.launch")
        if self.debug_single:
            parts.append("one replica (debug_single_process)")
        if self.runtime.described_as:
            parts.append(self.runtime.described_as)
        return ", ".join(parts)


def start(launch: Launch, entry: Callable, job, *, processes: int = 0,
          ended: Optional[Callable[[int, int], None]] = None) -> None:
    """Run ``entry(index, job)`` on every replica; return when all of them have ended.

    With ``processes``, start that many processes of one replica each here (the CPU
    simulation's default) and call ``ended(index, exit code)`` as each one ends: a
    replica whose process ended before its report is gone, and the others may wait for
    it in a collective."""
    with _main_not_rerun(launch.start_method):
        _start(launch, entry, job, processes, ended)


def _start(launch: Launch, entry: Callable, job, processes: int, ended) -> None:
    if processes:
        _start_processes(launch, entry, job, processes, ended)
        return
    if job.environ is not None:  # (xmp.spawn's processes take the job's environment)
        job = dataclasses.replace(job, environ={**job.environ,
                                                **_run_environ(job.environ, job.run_dir)})
    if launch.debug_single:
        process = multiprocessing.get_context(launch.start_method).Process(
            target=replica_entry.single_replica, args=(entry, job), name="colab_xla-debug-single")
        process.start()
        process.join()
        return
    if launch.launcher == "launch":
        import torch_xla

        torch_xla.launch(entry, args=(job,), start_method=launch.start_method)
    else:
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(entry, args=(job,), nprocs=None, start_method=launch.start_method)


@contextlib.contextmanager
def _main_not_rerun(start_method: str) -> Iterator[None]:
    """Without fork, multiprocessing runs the parent's main script again in every child
    (as ``__mp_main__``), for the functions it defines. A replica needs none of them (the
    cell and the notebook names travel in its job), and where the main script is not the
    notebook's that costs every replica its imports (in a cluster host's agent, whose main
    is Ray's worker script). A spec named ``__main__`` tells
    multiprocessing not to run it (as for ``python -m package``)."""
    main = sys.modules.get("__main__")
    if (start_method == "fork" or main is None or getattr(main, "__spec__", None) is not None
            or not getattr(main, "__file__", None)):
        yield  # forked, a notebook (no script), or run as a module: nothing to run again
        return
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    try:
        yield
    finally:
        main.__spec__ = None


def _start_processes(launch: Launch, entry: Callable, job, count: int,
                     ended: Optional[Callable[[int, int], None]]) -> None:
    context = multiprocessing.get_context(launch.start_method)
    rank_env = {"PJRT_LOCAL_PROCESS_COUNT": str(count)}
    if job.environ is not None:
        rank_env.update(meeting_place(job.environ, free_port))
        rank_env.update(_run_environ({**job.environ, **rank_env}, job.run_dir))
    replicas = [context.Process(target=replica_entry.replica_process,
                                name=f"colab_xla-replica-{index}",
                                args=(entry, index, job, rank_env, launch.start_method == "fork"))
                for index in range(count)]
    for process in replicas:
        process.start()
    pending = {process.sentinel: (index, process) for index, process in enumerate(replicas)}
    while pending:
        multiprocessing.connection.wait(list(pending), timeout=_EXIT_POLL_SECONDS)
        for sentinel, (index, process) in list(pending.items()):
            # exitcode asks waitpid: a sentinel is a pipe that a child the replica started
            # (and outlived it) may still hold open, so it alone can miss the end.
            if process.exitcode is None:
                continue
            del pending[sentinel]
            process.join()
            if ended is not None:
                ended(index, process.exitcode)


def _run_environ(environ: Mapping[str, str], run_dir: str) -> Dict[str, str]:
    """What the replicas' runtime adds for one run (where its processes meet), as the
    replicas will know it: from their environment, ``environ``."""
    return runtimes.current(environ).run_environ(environ, free_port,
                                                 functools.partial(run_socket, run_dir))


def run_socket(run_dir: str, name: str) -> Optional[str]:
    """The path of a Unix socket named ``name`` in the run's private directory
    ``run_dir`` (only this user can enter it), or None where that path would be too long
    for a Unix socket (a long TMPDIR)."""
    return os.path.join(run_dir, name) if state.fits_socket(run_dir, name) else None


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port of ``address`` (this machine's) free right now."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def warm_forkserver() -> Tuple[int, bool]:
    """Start the forkserver once per notebook process, importing torch and torch_xla in
    it (in the background: the first run waits for it). Return its pid, and whether this
    call started it.

    Its environment is the notebook's at that moment; each run's own variables are set in
    its replicas when they arrive (see ``colab_xla.wire.job.ReplicaJob``). If something else
    started the forkserver first, it is used as it is, without the preloaded modules.
    """
    from multiprocessing import forkserver

    before = forkserver_pid()
    if before is None:
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    from ..wire.job import NOTEBOOK_PID

    # PJRT_SELECT_DEFAULT_DEVICE: see torch_xla_import.import_torch_xla.
    with environ({"PJRT_SELECT_DEFAULT_DEVICE": "0", NOTEBOOK_PID: str(os.getpid())}), \
            _multiprocessing_files_in_work_dir():
        forkserver.ensure_running()  # (starts it again if it died)
    now = forkserver_pid()
    return now, now != before


@contextlib.contextmanager
def _multiprocessing_files_in_work_dir() -> Iterator[None]:
    """The files multiprocessing makes meanwhile for this process (the forkserver's
    socket) in this process's work directory, where it has not made its own ``pymp-*``
    directory in /tmp yet. A process killed with its forkserver up (a kernel restarted or
    shut down at once; a cluster's host agent, ended by ``ray.kill``) left that directory
    for good; the next colab_xla process's sweep removes a dead one's work directory
    (:func:`colab_xla.notebook.state.own_dir`). Only meanwhile: the ``pymp-*`` directory of
    the notebook's own multiprocessing (the user's managers, queues) stays its own."""
    # (where multiprocessing.util.get_temp_dir looks for it, and keeps what it made)
    config = multiprocessing.current_process()._config
    work = state.own_dir("work")
    # (the socket's name: "listener-" and the 8 characters of a tempfile name)
    if "tempdir" in config or not state.fits_socket(work, "listener-12345678"):
        yield
        return
    config["tempdir"] = work
    try:
        yield
    finally:
        if config.get("tempdir") == work:
            del config["tempdir"]


def wait_forkserver() -> None:
    """Return once the forkserver (started by :func:`warm_forkserver`) has imported what
    it preloads: it forks nothing before, so one empty process started through it and
    reaped is the sign (once per forkserver: at once after that). A run started after
    this does not wait for the imports, which its stop could not cut short (its launcher
    would be blocked reading the forkserver's answer); here, in the caller's thread,
    an Interrupt ends the wait."""
    global _warm_forkserver
    if _warm_forkserver is not None and _warm_forkserver == forkserver_pid():
        return
    empty = multiprocessing.get_context("forkserver").Process(
        target=os._exit, args=(0,), name="colab_xla-forkserver-warm")
    try:
        empty.start()
    except (EOFError, OSError) as exc:  # it ended before it could fork
        raise SetupError(
            f"the forkserver ended while it imported torch and torch_xla ({type(exc).__name__}"
            f": {exc}); nothing started. Its error is in this process's stderr (a notebook "
            "kernel's log). Run the cell again to start a new one, or use --start-method "
            "fork or spawn.") from None
    empty.join()
    _warm_forkserver = forkserver_pid()


_warm_forkserver: Optional[int] = None  # the forkserver wait_forkserver saw warm


def forkserver_pid() -> Optional[int]:
    """The forkserver's pid if colab_xla (or anything) started it, else None."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def replica_environ(changes: Mapping[str, Optional[str]],
                    base: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The replicas' whole environment: ``base`` with ``changes`` (None: unset)."""
    env = dict(base)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@contextlib.contextmanager
def environ(changes: Mapping[str, Optional[str]]) -> Iterator[None]:
    """Set (or, for None, unset) variables in this process for a while; put them back
    after. (xmp.spawn reads PJRT_DEVICE in the launching process.)"""
    saved = {k: os.environ.get(k) for k in changes}
    _set_environ(changes)
    try:
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: Mapping[str, Optional[str]]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
