"""Replicas kept warm across cells: a *session* (``%xla_session``), from the notebook's side.

:meth:`Session.start` starts the replicas as a run does (the same plan, launcher,
environment and checks) but each runs :func:`colab_xla.replica.serve.serve`: it stays up
and runs every cell the notebook sends, keeping its globals, its compiled graphs and its
process. While a session is up, :func:`colab_xla.notebook.run.run_cell` runs cells on it: each cell
is a run of its own (pipes, frames, reports, views, fail-fast: the
:class:`colab_xla.notebook.supervisor.Supervisor`), whose replicas are the session's
(:class:`SessionReplicas`).

* The notebook names a cell uses travel with it (cloudpickle, as for a replica that does
  not fork) when the replicas do not have them yet, or when the name was given another
  object in the notebook since they got it (a weak reference tells, or for plain data
  its serialized bytes); what a replica assigned itself stays until then.
* An Interrupt (also ``--timeout`` and fail-fast) raises KeyboardInterrupt in every
  replica's cell; if one is not back within :data:`INTERRUPT_GRACE_SECONDS` (native code,
  a collective waiting for a peer), the session ends: every process it started is killed.
* A replica whose process dies ends the session, with how it died. The session's
  processes die with the notebook's (parent-death signal) and are in the pid registry,
  where a later notebook process (its runs, ``%xla_doctor``) finds any that outlived it.
  A notebook process that exits normally stops its sessions first (see
  :func:`_stopped_at_exit`).

The plan and the checks before the start are a run's: :func:`colab_xla.notebook.run.new_session`
makes them (and :func:`colab_xla.notebook.run.start_session` makes the session this notebook
process's, :func:`make_current`).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import importlib
import json
import os
import pickle
import secrets
import select
import shutil
import signal
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import cloudpickle
import psutil

from .. import hardware, processes, state
from ..endings import describe_exit
from ...errors import SetupError
from ...wire.host_rank import HostRank
from ..launch import Launch, environ, inherit, replica_environ, serve_replica, start
from ...wire.cell import Cell
from ...wire.job import ReplicaJob, command_path
from ..supervisor import Replicas
from ...wire import frames, names

# After an Interrupt (or --timeout, or fail-fast), how long every replica has to finish its
# cell before the session is ended.
INTERRUPT_GRACE_SECONDS = 2.0
# How long the replicas may take to start (import torch_xla, start the runtime).
START_TIMEOUT_SECONDS = 300.0
# How long the processes of an ending session may take to go (killed until then).
_KILL_SECONDS = 5.0
# Why a session ended when its launcher saw every replica process end, unless it knows more.
_PROCESSES_ENDED = "its replica processes ended"


_DID_NOT_START = ("%xla_doctor checks the environment; a one-off %%xla_spawn cell shows how a "
                  "replica fails to start.")


class SessionError(SetupError):
    """A session that cannot do what was asked (none is up, a cell asks what only a new
    session can give, the replicas did not start)."""


@dataclasses.dataclass(frozen=True)
class SessionOptions:
    """What ``%xla_session start`` was given: kept for ``restart``."""

    replicas: Optional[int] = None
    launch: Launch = Launch()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cache_dir: Optional[str] = None
    simulate: Optional[str] = None


@dataclasses.dataclass
class SessionReplica:
    """One replica of a session, as ``%xla_session`` shows it."""

    index: int
    pid: int
    rank: int


class Session:
    """Replicas started once, running cell after cell. Make one with :meth:`start`."""

    def __init__(self, opts: SessionOptions, plan: hardware.ReplicaPlan, directory: str):
        self.options, self.plan, self.directory = opts, plan, directory
        self.id = "session-" + secrets.token_hex(6)
        self.processes = processes.RunProcesses(self.id)
        self.replicas: Dict[int, SessionReplica] = {}
        self.started_at = time.time()
        self.cells_run = 0
        self.ended: Optional[str] = None  # why the session ended, once it has
        self._lock = threading.Condition()
        self._commands: Dict[int, int] = {}  # ordinal -> write fd of its command pipe
        self.known = KnownNames()  # the notebook names the replicas have
        # On a cluster's host (started by its agent): where its replicas count globally.
        self._host_rank = HostRank.from_environ(opts.env)
        self._cell: Optional[_CellRun] = None  # the cell running now
        self._died: Dict[int, int] = {}  # replica -> exit code of its process
        self._launcher: Optional[threading.Thread] = None
        self._launch_error: Optional[BaseException] = None
        self._stopping = False  # processes that end from now on were ended on purpose
        self._output: List[str] = []  # what the replicas printed outside any cell (last lines)
        self._channel = self._startup = (-1, -1)  # the session's own pipes (read, write)

    # -- start and stop ---------------------------------------------------------------------

    @classmethod
    def start(cls, opts: SessionOptions, plan: hardware.ReplicaPlan, parent_pid: int,
              cache_dir: Optional[str], user_ns: Mapping[str, Any]) -> "Session":
        """Start the replicas ``plan`` says (``parent_pid``: the replica processes'
        parent, this process or the forkserver; ``cache_dir`` checked) and wait until every
        one is ready; raise :class:`SessionError` (with what they printed) if they cannot."""
        session = cls(opts, plan, state.new_work_dir("session-"))
        _stopped_at_exit(session)
        try:
            session._start(parent_pid, cache_dir, dict(user_ns))
        except BaseException:
            session.end("it did not start")
            raise
        return session

    def _start(self, parent_pid: int, cache_dir: Optional[str], user_ns: Dict[str, Any]) -> None:
        channel = os.path.join(self.directory, "channel")
        self._channel = frames.make_fifo(channel)
        startup = os.path.join(self.directory, "startup")
        self._startup = frames.make_fifo(startup)
        self._decoder = frames.FrameDecoder()
        job = ReplicaJob(run_id=self.id, run_dir=self.directory, channel_path=channel,
                         parent_pid=parent_pid, fd_paths=((startup, startup),),
                         startup_path=startup, environ=replica_environ(self.plan.env),
                         cache_dir=cache_dir)
        for index in range(self.plan.replicas or 0):  # (others make their own: see serve)
            path = command_path(self.directory, index)
            os.mkfifo(path, 0o600)
            self._commands[index] = os.open(path, os.O_RDWR)  # never blocks
        self.processes.begin()
        self._launcher = threading.Thread(target=self._launch, args=(job,), daemon=True,
                                          name="colab_xla-session")
        with inherit(self.id, user_ns, None):  # (forked replicas: the notebook's names)
            self._launcher.start()
            self._wait_ready()

    def _launch(self, job: ReplicaJob) -> None:
        try:
            with environ(self.plan.env):
                start(self.options.launch, serve_replica, job,
                      processes=self.plan.processes if self.plan.own_processes else 0,
                      ended=self._process_ended)
        except BaseException as exc:  # noqa: BLE001 - the session ends, and says why
            self._launch_error = exc
        finally:
            with self._lock:
                if self.ended is None:
                    self.ended = self.death_reason or _PROCESSES_ENDED
                self._lock.notify_all()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        expected = self.plan.replicas
        while expected is None or len(self.replicas) < expected:
            if self.ended is not None or not self._launcher.is_alive():
                error = self._launch_error
                why = (f"{type(error).__name__}: {error}" if error
                       else self.ended or _PROCESSES_ENDED)
                raise SessionError(f"The session's replicas did not start ({why}). "
                                   f"{_DID_NOT_START}" + self._printed())
            if time.monotonic() > deadline:
                raise SessionError(f"The session's replicas did not start within "
                                   f"{START_TIMEOUT_SECONDS:.0f} s. {_DID_NOT_START}"
                                   + self._printed())
            for note in self._read_channel(0.2):
                if "ready" in note:
                    index = note["ordinal"]
                    self.replicas[index] = SessionReplica(index, note["ready"], note["rank"])
                    self.processes.track(note["ready"])
                    expected = expected or note.get("world")
        self.processes.stop_adopting()
        for index in self.replicas:
            if index not in self._commands:
                self._commands[index] = os.open(
                    command_path(self.directory, index), os.O_WRONLY)

    def _read_channel(self, wait: float) -> List[dict]:
        """Notes the replicas sent on the session's own pipe; what they printed outside a
        cell is kept (the last lines)."""
        notes = []
        fds = [self._channel[0], self._startup[0]]
        readable, _, _ = select.select(fds, [], [], wait)
        for fd in readable:
            data = os.read(fd, 1 << 16)
            if fd == self._startup[0]:
                self._keep(data)
                continue
            for frame in self._decoder.feed(data):
                if frame.kind == frames.NOTE:
                    notes.append({**json.loads(frame.payload), "ordinal": frame.ordinal})
                elif frame.kind in frames.STREAMS:
                    self._keep(frame.payload)
        return notes

    def _keep(self, data: bytes) -> None:
        self._output = (self._output + data.decode("utf-8", "replace").splitlines())[-40:]

    def _printed(self) -> str:
        """What the replicas printed outside a cell (start-up), as the end of a message."""
        fds = [self._channel[0], self._startup[0]]
        while select.select(fds, [], [], 0)[0]:
            self._read_channel(0)
        if not self._output:
            return ""
        return "\nWhat they printed:\n" + "\n".join("  " + line for line in self._output)

    def stop(self) -> None:
        """End the session: tell the replicas, then kill whatever is left."""
        self._stopping = True
        for fd in self._commands.values():
            try:
                os.write(fd, b"stop\n")
            except OSError:
                pass
        if self._launcher is not None:
            self._launcher.join(INTERRUPT_GRACE_SECONDS)
        self.end("stopped (%xla_session stop)")

    def end(self, reason: str) -> None:
        """Kill every process of the session (by pid) and remove its files; ``reason``
        is what ``%xla_session`` and the cell say about it."""
        self._stopping = True
        with self._lock:
            if self.ended in (None, _PROCESSES_ENDED):
                self.ended = self.death_reason or reason
            self._lock.notify_all()
        if self._launcher is not None:
            self.processes.kill_until_ended(self._launcher, _KILL_SECONDS)
        else:
            self.processes.kill()
        for fd in (*self._commands.values(), *self._channel, *self._startup):
            if fd >= 0:
                os.close(fd)
        self._commands.clear()
        self._channel = self._startup = (-1, -1)
        shutil.rmtree(self.directory, ignore_errors=True)
        self._launch_error = None  # (its traceback holds the launcher's frames)

    @property
    def up(self) -> bool:
        return self.ended is None

    def check_up(self) -> None:
        """Refuse a cell on a session that has ended, or whose replica died since the
        last cell (the session is ended then), saying why."""
        if self._died and self.ended is None:
            self.end(self.death_reason)
        if self.ended is not None:
            raise self._ended_error()

    def _ended_error(self) -> SessionError:
        return SessionError(f"The session has ended: {self.ended}. %xla_session start "
                            "starts a new one (%xla_session restart: with the same "
                            "options); --fresh runs one cell without it.")

    def check_cell_options(self, *, replicas: Optional[int], launch: Optional[Launch],
                           env: Mapping[str, str], cache_dir: Optional[str],
                           simulate: Optional[str]) -> None:
        """Refuse a cell that asks its replicas for what only a new session can give:
        another count, start method, launcher, environment, cache or simulation (None,
        empty: not asked)."""
        own = self.options.launch
        asked = [flag for flag, given in (
            ("-n", replicas is not None and replicas != len(self.replicas)),
            ("--start-method", launch is not None and launch.start_method != own.start_method),
            ("--launcher", launch is not None and launch.launcher != own.launcher),
            ("--debug-single", launch is not None and launch.debug_single),
            ("--runtime", launch is not None and launch.runtime != own.runtime),
            ("--devices-per-process", launch is not None
             and launch.devices_per_process not in (None, own.devices_per_process)),
            ("--env", env), ("--cache", cache_dir), ("--simulate", simulate)) if given]
        if asked:
            raise SessionError(
                f"{', '.join(asked)}: this session's replicas were started with their own "
                f"options ({self.describe_options()}), which a cell cannot change. Run this "
                "cell with --fresh (a one-off run beside the session), or %xla_session "
                "restart with the options you want (%xla_session stop, then %xla_session "
                "start ...).")

    # -- what dies ------------------------------------------------------------------------

    def _process_ended(self, index: int, code: int) -> None:
        """In the launcher thread: replica ``index``'s own process ended."""
        if self._stopping:
            return
        with self._lock:
            self._died.setdefault(index, code)
            cell = self._cell
            self._lock.notify_all()
        if cell is not None and index not in cell.finished:
            cell.ended(index, code)

    @property
    def death_reason(self) -> Optional[str]:
        """How the first replica that died went (None while none did)."""
        if not self._died:
            return None
        index, code = sorted(self._died.items())[0]
        return f"replica {self.global_ordinal(index)} died ({describe_exit(code)})"

    def global_ordinal(self, index: int) -> int:
        """Replica ``index``'s ordinal as the notebook counts it: on a cluster's host
        (started by its agent), counting every host's replicas."""
        rank = self._host_rank
        return index if rank is None else rank.index(index)

    def exit_codes(self) -> List[int]:
        """The non-zero exit codes of the session's processes that ended."""
        return sorted({code for code in self._died.values() if code}
                      | set(self.processes.exit_codes()))

    # -- cells ------------------------------------------------------------------------------

    def dispatch(self, job: ReplicaJob, ended: Callable[[int, int], None]) -> None:
        """In the supervisor's driver thread: run ``job`` on every replica, and return when
        every one has sent its end, or the session has ended."""
        path = os.path.join(job.run_dir, "job.pickle")
        with open(path, "wb") as f:
            pickle.dump(job, f, protocol=pickle.HIGHEST_PROTOCOL)
        cell = _CellRun(job.run_id, ended)
        with self._lock:
            if self.ended is not None:
                raise self._ended_error()
            self._cell = cell
            self.cells_run += 1
        try:
            self._send_all(f"run {path}")
            with self._lock:
                while len(cell.finished) < len(self.replicas) and self.ended is None:
                    self._lock.wait(0.5)
                if self.ended is not None:  # the replicas that never ended died with it
                    codes = self.processes.exit_codes() or [-signal.SIGKILL]  # (killed here)
                    for index in self.replicas:
                        if index not in cell.finished:
                            ended(index, self._died.get(index, codes[0]))
        finally:
            with self._lock:
                self._cell = None

    def finished(self, run_id: str, ordinal: int) -> None:
        with self._lock:
            if self._cell is not None and self._cell.run_id == run_id:
                self._cell.finished.add(ordinal)
                self._lock.notify_all()

    def interrupt(self, run_id: str) -> None:
        """KeyboardInterrupt in every replica still running the cell ``run_id``."""
        with self._lock:
            running = [i for i in self.replicas
                       if self._cell is None or i not in self._cell.finished]
        self._send_all(f"interrupt {run_id}", running)

    def _send_all(self, command: str, ordinals=None) -> None:
        line = command.encode() + b"\n"
        for index in self.replicas if ordinals is None else ordinals:
            fd = self._commands.get(index)
            if fd is not None:
                try:
                    os.write(fd, line)
                except OSError:  # its process is gone: the launcher tells
                    pass

    # -- what a person sees -----------------------------------------------------------------

    def describe_options(self) -> str:
        """The options the session was started with, as a line would give them."""
        opts = self.options
        parts = [f"-n {len(self.replicas) or self.plan.replicas}",
                 f"--start-method {opts.launch.start_method}"]
        if opts.launch.runtime != "torch_xla":
            parts.append(f"--runtime {opts.launch.runtime}")
        if opts.launch.devices_per_process is not None:
            parts.append(f"--devices-per-process {opts.launch.devices_per_process}")
        if self.plan.simulation:
            parts.append(f"--simulate {self.plan.simulation}")
        parts += [f"--env {key}={value}" for key, value in opts.env.items()]
        if opts.cache_dir:
            parts.append(f"--cache {opts.cache_dir}")
        return " ".join(parts)

    def describe(self) -> str:
        """``%xla_session``'s status text."""
        if self.ended is not None:
            return f"colab_xla session: ended ({self.ended})."
        uptime = time.time() - self.started_at
        device = self.plan.device_type
        if self.plan.simulation:
            device += f", simulated as {self.plan.simulation}"
        lines = [f"colab_xla session: up {uptime:.0f} s, {len(self.replicas)} replicas on "
                 f"{device}, {self.cells_run} cell{'s' if self.cells_run != 1 else ''} run, "
                 f"started with {self.options.launch.start_method}."]
        for rep in sorted(self.replicas.values(), key=lambda r: r.index):
            try:
                rss = psutil.Process(rep.pid).memory_info().rss / 2**20
                memory = f"{rss:,.0f} MiB"
            except psutil.Error:
                memory = "gone"
            lines.append(f"  replica {self.global_ordinal(rep.index)}: pid {rep.pid}, "
                         f"process {rep.rank}, memory {memory}")
        return "\n".join(lines)


@dataclasses.dataclass
class _CellRun:
    run_id: str
    ended: Callable[[int, int], None]
    finished: set = dataclasses.field(default_factory=set)


class KnownNames:
    """The notebook names warm replicas have (a session's, here or on every host of a
    cluster), as they were when sent: a name goes again when the notebook gave it another
    object since, or changed plain data in place."""

    def __init__(self):
        self._known: Dict[str, _Known] = {}

    def pack(self, cell: Cell,
             user_ns: Mapping[str, Any]) -> Tuple[Optional[bytes], List[str]]:
        """The names ``cell`` uses that the replicas do not have as they are in
        ``user_ns``: packed (None if none), and their names."""
        changed = []
        for name in names.used_names(cell, user_ns):
            known = self._known.get(name)
            if known is None or known.changed(user_ns[name]):
                changed.append(name)
        if not changed:
            return None, []
        return names.pack(changed, user_ns, names.SESSION), changed

    def sent(self, sent_names: List[str], user_ns: Mapping[str, Any]) -> None:
        """The replicas now have ``sent_names`` as ``user_ns`` has them."""
        for name in sent_names:
            self._known[name] = _Known(user_ns[name])


class _Known:
    """What the replicas have of a notebook name: its object (weakly where it can be),
    and for plain data, which cannot be referenced weakly, its serialized bytes' digest
    (so that a list changed in place is sent again)."""

    def __init__(self, value):
        try:
            self._ref = weakref.ref(value)
            self._digest = None
        except TypeError:
            self._ref = lambda value=value: value
            self._digest = _digest(value)

    def changed(self, value) -> bool:
        if self._ref() is not value:
            return True
        return self._digest is not None and _digest(value) != self._digest


def _digest(value) -> Optional[bytes]:
    try:
        return hashlib.blake2b(cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL),
                               digest_size=16).digest()
    except Exception:  # noqa: BLE001 - packing it says why, if a cell sends it
        return None


class SessionReplicas(Replicas):
    """A session's replicas, as one cell's :class:`colab_xla.notebook.supervisor.Supervisor` sees
    them: the cell is sent to them, and a cut run interrupts them instead of killing
    them, unless they do not come back in time."""

    def __init__(self, session: Session):
        self.session, self.run_id = session, None
        self.grace = INTERRUPT_GRACE_SECONDS
        # Set when every replica has ended the cell (or the session has ended). The driver
        # thread is alive a moment longer (it tells the supervisor first): its is_alive()
        # would count a cell that ended in time as one still running.
        self._returned = threading.Event()

    def drive(self, job: ReplicaJob, ended) -> None:
        self.run_id = job.run_id
        try:
            self.session.dispatch(job, ended)
        finally:
            self._returned.set()

    def started(self, pid: int) -> None:
        self.session.processes.track(pid)

    def finished(self, ordinal: int) -> None:
        self.session.finished(self.run_id, ordinal)

    def tick(self) -> None:
        self.session.processes.track_descendants()

    def exit_codes(self) -> List[int]:
        return self.session.exit_codes()

    def stop(self, driver: threading.Thread, read_until) -> None:
        if self.session.ended is None and self.session.death_reason is None:
            self.session.interrupt(self.run_id)
            read_until(time.monotonic() + self.grace)
        self._end_if_running(driver)

    def release(self, driver: threading.Thread) -> None:
        if (not self._returned.is_set() and self.session.ended is None
                and self.session.death_reason is None):
            self.session.interrupt(self.run_id)  # (a view failed while the cell ran)
            self._returned.wait(self.grace)
        self._end_if_running(driver)

    def _end_if_running(self, driver: threading.Thread) -> None:
        """End the session if the cell still runs (a replica did not stop) or a replica
        died: the replicas are no longer one group that can run the next cell."""
        if not self._returned.is_set():
            self.session.end(self.session.death_reason or (
                f"a replica did not stop within {self.grace:g} s of the interrupt (native "
                "code, or a collective waiting for a peer)"))
        elif self.session.death_reason is not None and self.session.ended is None:
            self.session.end(self.session.death_reason)
        driver.join(_KILL_SECONDS)


# -- the end of the notebook's process ----------------------------------------------------------

_up: "weakref.WeakSet[Session]" = weakref.WeakSet()  # the sessions this process started
_exit_hook_pid: Optional[int] = None


def _stopped_at_exit(session: Session) -> None:
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
        atexit.register(_stop_sessions)
    else:
        register(_stop_sessions)
    _exit_hook_pid = os.getpid()


def _stop_sessions() -> None:
    if os.getpid() != _exit_hook_pid:  # a child forked from this process, ending
        return
    for session in list(_up):
        if session.up:
            session.stop()


# -- the notebook's session -------------------------------------------------------------------

_current: Optional[Session] = None


def current() -> Optional[Session]:
    """The session of this notebook process, up or ended (None if none was started)."""
    return _current


def check_none_up() -> None:
    """Refuse a second session while one is up."""
    if _current is not None and _current.up:
        raise SessionError("A session is already up: %xla_session stop ends it, "
                           "%xla_session restart starts it again.")


def make_current(session: Session) -> Session:
    """Make ``session`` this notebook process's (see :func:`colab_xla.notebook.run.start_session`)."""
    global _current
    check_none_up()
    _current = session
    return session


def stop_session() -> Optional[Session]:
    global _current
    session, _current = _current, None
    if session is not None and session.up:
        session.stop()
    return session
