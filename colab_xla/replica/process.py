"""A replica process, set up once per run: where its output goes, what it inherits or
receives from the notebook, and what it changes in tqdm, ``os`` and multiprocessing so
that a cell behaves there as in a notebook; then its runtime's own set-up
(:meth:`colab_xla.runtimes.Runtime.start_process`: torch_xla instrumented, or the JAX
process's place in its job).

:class:`ReplicaProcess` is made by the first replica of a run to start in the process
(several replicas may be threads of one process) and shared by the others.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import sys
import threading
import traceback
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, NamedTuple, Optional, Tuple

import cloudpickle

from .. import runtimes
from ..runtimes import runtime_clients, thread
from ..runtimes.bound_names import Bindings
from ..wire.host_rank import HostRank
from ..wire.cell import CellModule
from ..wire.reports import ReplicaError
from ..wire.lifetime import adopt_orphans, die_with_parent
from ..wire import names
from ..wire.frames import NOTE, STDERR, STDOUT, ChannelWriter
from ..wire.values import lookup
from . import progress
from .capture import (ReplicaStream, capture_fds, flush_all, no_stdin, replica_display,
                      streams_per_thread)

if TYPE_CHECKING:
    from ..wire.job import ReplicaJob

# Set in the notebook around the fork (see inherit), read by the replicas: run id -> state.
_FORKED: Dict[str, "ForkedState"] = {}


@dataclass(frozen=True)
class ForkedState:
    """What a forked replica inherits instead of receiving it pickled."""

    user_ns: Dict[str, Any]
    cell: CellModule
    bindings: Bindings  # the names bound to functions the runtime replaces, found here


@contextlib.contextmanager
def inherit(run_id: str, user_ns: Dict[str, Any], cell: CellModule,
            replaced: Tuple[str, ...] = ()) -> Iterator[None]:
    """In the notebook, around the start of forked replicas: what they inherit (the
    notebook's names and the cell) instead of receiving it pickled, and where names are
    bound to the functions of the modules the runtime replaces (``replaced``: its
    :attr:`~colab_xla.runtimes.Runtime.replaces`)."""
    _FORKED[run_id] = ForkedState(user_ns, cell, Bindings.find(replaced, user_ns))
    try:
        yield
    finally:
        _FORKED.pop(run_id, None)


class _Opened(NamedTuple):
    """The pipes and ring a replica process writes to (see ReplicaProcess.open_pipes)."""

    channel_path: Optional[str]
    ring_dir: Optional[str]
    fd_paths: Optional[Tuple[str, str]]


class ReplicaProcess:
    """A replica process: set up once (streams, parent-death signal, its runtime's
    set-up), then opened for each run it serves (the run's pipes, its cell and the
    notebook's names). A one-off run's process serves one run; a session's serves one run
    per cell (:mod:`colab_xla.replica.serve`)."""

    _lock = threading.Lock()
    _current: Optional["ReplicaProcess"] = None

    @classmethod
    def get(cls, job: ReplicaJob) -> "ReplicaProcess":
        """The process, opened for ``job``'s run (by the first of its replicas to ask)."""
        with cls._lock:
            if cls._current is None:
                cls._current = cls(job)
            elif cls._current.run_id != job.run_id:
                cls._current.open_run(job)
            return cls._current

    def __init__(self, job: ReplicaJob):
        die_with_parent(job.parent_pid)
        adopt_orphans()
        _python_print()
        self.active: set = set()
        self.rank = int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0"))
        self.host_rank = HostRank.from_environ(os.environ)  # on a cluster of hosts, or None
        self.run_id, self.run_dir, self.writer = None, None, None
        self._opened = _Opened(None, None, None)  # the pipes and ring written to now
        self.home_dir = job.run_dir  # the first run's (a session's own directory)
        self.cell: Optional[CellModule] = None
        # The notebook's names this process has (inherited at the fork, or received);
        # in a session, what each cell receives adds to them.
        self.user_ns: Dict[str, Any] = {}
        self.received: Dict[str, Any] = {}  # what the run being served received
        # Where names were bound before the fork (None: not forked): for the runtime's
        # replacements (colab_xla.runtimes.bound_names).
        self.bindings: Optional[Bindings] = None
        self.open_run(job)
        thread.claim_started_threads()  # (output of a thread a cell starts: its replica's)
        self._capture_streams()
        no_stdin()
        progress.install(self)  # tqdm bars drawn by the notebook
        _send_cell_definitions_by_value()
        _serialize_forks()
        _report_exits(self)
        runtime_clients.install(self.call_site)  # MegaScale discovery once per process
        runtimes.current().start_process(self, job)  # (torch_xla instrumented, JAX joined)

    def open_run(self, job: ReplicaJob) -> None:
        """Serve ``job``'s run from now on: its pipes, its cell, the names it brings."""
        self.open_pipes(job)
        self.names_error: Optional[ReplicaError] = None
        forked = _FORKED.get(job.run_id)
        if job.cell is None and forked is not None:  # forked: names and cell inherited
            self.user_ns, self.received, self.cell = forked.user_ns, {}, forked.cell
            self.bindings = forked.bindings
        else:
            self.received = self._load_names(job)
            self.user_ns = {**self.user_ns, **self.received}
            self.cell = job.cell

    def open_pipes(self, job: ReplicaJob) -> None:
        """Write to ``job``'s pipes from now on, opening only what changed; the names and
        the cell stay. A session's replicas write to the session's pipes from their start
        to their end: its first cell gives each process its ring and its own pipes for
        C-level output, and a cell after it opens nothing."""
        if self.run_dir in sys.path and self.run_dir not in (self.home_dir, job.run_dir):
            sys.path.remove(self.run_dir)
        self.run_id, self.run_dir = job.run_id, job.run_dir
        # Named pipes, opened by path: a process started by spawn or a forkserver inherits
        # no descriptors from the notebook. The writer keeps its descriptor from run to run
        # (a thread the cell left running may be writing to it).
        _, ring_dir, fd_paths = self._opened
        if self.writer is None:
            self.writer = ChannelWriter(os.open(job.channel_path, os.O_WRONLY))
        elif job.channel_path != self._opened.channel_path:
            self.writer.retarget(job.channel_path)
            ring_dir = None  # (frames go to the new pipe, until a ring is named again)
        if job.ring_dir and job.ring_dir != ring_dir:
            try:
                self.writer.use_ring(os.path.join(job.ring_dir, f"ring-{os.getpid()}"))
                ring_dir = job.ring_dir
            except OSError:  # no room for the ring's file: frames go to the pipe
                pass
        if job.run_dir not in sys.path:
            sys.path.insert(0, job.run_dir)  # the cell's module imports by name
        if job.fd_paths and job.fd_paths[self.rank % len(job.fd_paths)] != fd_paths:
            fd_paths = job.fd_paths[self.rank % len(job.fd_paths)]
            capture_fds(fd_paths)
        self._opened = _Opened(job.channel_path, ring_dir, fd_paths)

    def _load_names(self, job: ReplicaJob) -> Dict[str, Any]:
        try:
            return names.unpack(job.names) if job.names else {}
        except Exception as exc:  # noqa: BLE001 - every replica of the process says it
            message = names.unloadable(exc)
            self.names_error = ReplicaError(
                "names", type(exc).__name__, message,
                "".join(traceback.format_exception(exc)) + message + "\n")
            return {}

    def call_site(self) -> str:
        """The line of the cell this thread is running (for what a call made)."""
        cell = self.cell
        return runtime_clients.call_site(cell.path if cell else None,
                                         cell.label if cell else "the cell")

    def enter(self, ordinal: int) -> None:
        with self._lock:
            self.active.add(ordinal)

    def leave(self, ordinal: int) -> bool:
        """True for the call that took the process's last replica out."""
        with self._lock:
            was_in = ordinal in self.active
            self.active.discard(ordinal)
            return was_in and not self.active

    def ordinal(self) -> int:
        """Whose the calling thread's output is: its replica's (or that of the replica
        whose thread started it: :func:`.thread.replica`); else, for a thread no replica
        started, the process's one replica running, or -1 (the process's own)."""
        ordinal = thread.replica()
        if ordinal is not None:
            return ordinal
        active = self.active
        return next(iter(active)) if len(active) == 1 else -1

    def _capture_streams(self) -> None:
        inherited = (sys.stdout, sys.stderr)
        streams = (ReplicaStream(self, STDOUT, "<replica stdout>"),
                   ReplicaStream(self, STDERR, "<replica stderr>"))
        streams_per_thread(*streams)
        # The "original" streams are the replica's too: the notebook's would write to the
        # kernel's own stdout, or be lost in its buffer when the process ends.
        sys.__stdout__, sys.__stderr__ = streams
        # Objects made before the fork (logging handlers) still hold the notebook's
        # ipykernel streams; a forked child writing through them loses and mixes text.
        for old, new in zip(inherited, streams):
            if type(old).__module__.startswith("ipykernel"):
                old.write, old.flush = new.write, new.flush
        replica_display(*streams)


def _python_print() -> None:
    """Python's own ``print`` in the replica, not Ray's.

    Ray's driver replaces ``builtins.print`` in the notebook with its
    ``tqdm_ray.safe_print`` the first time it prints a message of Ray's (a host's actor that
    died is one). That print takes a lock of Ray's, which a thread of Ray's may hold as the
    notebook forks: a forked replica's first ``print`` then waited for ever, and one that
    got through ran Ray's bar code around every line."""
    import builtins

    tqdm_ray = sys.modules.get("ray.experimental.tqdm_ray")
    if tqdm_ray is None or builtins.print is not getattr(tqdm_ray, "safe_print", None):
        return
    replaced = getattr(tqdm_ray, "_print", None)  # (what it replaced: private to Ray)
    if callable(replaced):
        builtins.print = replaced


def _report_exits(process: ReplicaProcess) -> None:
    """``os._exit`` from a replica's thread says who called it before the process ends.

    It ends the whole process at once, and with it every replica that is a thread of it:
    without this note the notebook could only say that the process ended "without an
    exit code". (The pid tells a replica from a process it forked, which shares its
    thread's state and calls ``os._exit`` too when it ends.)
    """
    real_exit = os._exit

    def reported_exit(code):
        ordinal = thread.replica()
        if ordinal is not None:
            with contextlib.suppress(Exception):
                flush_all()
                process.writer.send(NOTE, ordinal,
                                    json.dumps({"exit": code, "pid": os.getpid()}).encode())
        real_exit(code)

    os._exit = functools.wraps(real_exit)(reported_exit)


def _send_cell_definitions_by_value() -> None:
    """Let processes the cell starts (a DataLoader's workers) receive its classes and
    functions, under every start method.

    A spawned or forkserver worker unpickles a ``Dataset`` by importing its class's
    module: for a class of the cell that would run the whole cell again, and a class of
    the notebook (``__main__`` there) cannot be imported at all. multiprocessing pickles
    with ``ForkingPickler``; here it sends such classes and functions by value, with
    cloudpickle, as the notebook's names reach a replica that does not fork. Everything
    else (tensors, plain data) pickles as before.
    """
    from multiprocessing.reduction import ForkingPickler

    def reducer_override(pickler, obj):
        if isinstance(obj, (type, types.FunctionType)) and not _importable(obj):
            return cloudpickle.loads, (cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),)
        return NotImplemented

    ForkingPickler.reducer_override = reducer_override


def _serialize_forks() -> None:
    """Replicas that are threads of one process fork one at a time (DataLoader workers, a
    Pool). On Python 3.12+, filelock 4.2 (torch imports it) audits os.fork and makes it raise
    RuntimeError("os.fork is unsafe while filelock is changing descriptor ownership") while
    another thread of the process is inside os.fork, which concurrent replicas often are."""
    if getattr(os.fork, "_colab_xla_serialized", False):
        return
    real_fork, lock = os.fork, threading.Lock()

    @functools.wraps(real_fork)
    def fork():
        with lock:  # in the child too: the forking thread is the one that goes on there
            return real_fork()

    fork._colab_xla_serialized = True
    os.fork = fork


def _importable(obj) -> bool:
    """Whether a fresh process importing ``obj.__module__`` gets ``obj`` without running
    a cell: not for the cell's own module, nor for what lives in a ``__main__``."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    # (a module of the cell holds its globals: see colab_xla.replica.execution._ReplicaModule)
    if module is None or "_replica_globals" in vars(module) or module.__name__ == "__main__":
        return False
    try:
        return lookup(obj.__qualname__, vars(module)) is obj
    except (AttributeError, KeyError):
        return False
