"""Replicas kept warm across cells: a *session* (``%xla_session``), from the notebook's side.

:func:`new_session` plans, checks and announces a session's start as a one-off run's
(:mod:`colab_xla.notebook.targets.one_off`), then :meth:`Session.start` starts the
replicas, each running :func:`colab_xla.replica.serve.serve`: it stays up and runs every
cell the notebook sends, keeping its globals, its compiled graphs and its process. A
:class:`Session` is a :class:`~colab_xla.notebook.targets.target.Target`: each cell is a run
of its own (pipes, frames, reports, views, fail-fast: the
:class:`colab_xla.notebook.supervisor.Supervisor`), whose replicas are the session's
(:class:`~colab_xla.notebook.targets.session_replicas.SessionReplicas`).

* The notebook names a cell uses travel with it (cloudpickle, as for a replica that does
  not fork) when the replicas do not have them as the notebook does
  (:mod:`colab_xla.notebook.targets.known_names`); what a replica assigned itself stays
  until then.
* An Interrupt (also ``--timeout`` and fail-fast) raises KeyboardInterrupt in every
  replica's cell (through its command pipe:
  :mod:`colab_xla.notebook.targets.session_commands`); if one is not back
  within :data:`~colab_xla.notebook.targets.session_replicas.INTERRUPT_GRACE_SECONDS`
  (native code, a collective waiting for a peer), the session ends: every process it
  started is killed.
* A replica whose process dies ends the session, with how it died. The session's
  processes die with the notebook's (parent-death signal) and are in the pid registry,
  where a later notebook process (its runs, ``%xla_doctor``) finds any that outlived it.
  A notebook process that exits normally stops its sessions first
  (:mod:`colab_xla.notebook.targets.session_exit`).

The notebook's own session, the one ``%%xla_spawn`` cells run on, is kept by
:mod:`colab_xla.notebook.targets`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import secrets
import shutil
import signal
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import psutil

from .. import debugger, options, preflight, processes, state
from ... import runtimes
from ..defaults import Defaults
from ...errors import SetupError
from ...wire.host_rank import HostRank
from ..launch import Launch, environ, inherit, replica_environ, serve_replica, start
from ...wire.cell import CellModule
from ...wire.job import ReplicaJob, job_to_command
from ..outcome import RunObserver, RunOutcome, counted
from ..request import CellRequest, SessionRequest
from ..supervisor import RunRequest, Supervisor
from ...wire import completions, names, shared_tensors
from .one_off import said_once, planned, say_notes
from .session_commands import CommandPipes
from .session_deaths import PROCESSES_ENDED, ReplicaDeaths, how_processes_ended
from .session_exit import stop_at_exit
from .session_output import SessionPipes
from .session_replicas import INTERRUPT_GRACE_SECONDS, KILL_SECONDS, SessionReplicas
from .session_target import SessionTarget
from .target import REPLICA_OPTIONS, Owned
from ...runtimes.plan import ReplicaPlan

# How long the replicas may take to start (import torch_xla, start the runtime).
START_TIMEOUT_SECONDS = 300.0
# The part of a launch that each option asks (None: --debug-single, never the session's own).
_LAUNCH_PARTS = {"--start-method": "start_method", "--launcher": "launcher",
                 "--debug-single": None, "--runtime": "runtime",
                 "--devices-per-process": "devices_per_process"}

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

    @classmethod
    def asked(cls, request: SessionRequest) -> "SessionOptions":
        """What ``request`` asks of this machine's session (an
        :class:`~colab_xla.errors.OptionError` for a bad start method or ``--env``)."""
        return cls(replicas=request.replicas,
                   launch=Launch(request.start_method or request.defaults.start_method,
                                 runtime=request.runtime,
                                 devices_per_process=request.devices_per_process),
                   env=options.parse_env(request.env), cache_dir=request.cache_dir,
                   simulate=request.simulate)


@dataclasses.dataclass
class SessionReplica:
    """One replica of a session, as ``%xla_session`` shows it."""

    index: int
    pid: int
    rank: int


class Session(SessionTarget):
    """Replicas started once, running cell after cell. Make one with :func:`new_session`
    (or :meth:`start`, planned already). As a target, every option that chooses the
    replicas is the session's: a cell may repeat it, not change it (:meth:`refuse`).

    What it owns apart is in objects of its own: its replicas' command pipes
    (:class:`~colab_xla.notebook.targets.session_commands.CommandPipes`), their output pipes
    (:class:`~colab_xla.notebook.targets.session_output.SessionPipes`), their deaths
    (:class:`~colab_xla.notebook.targets.session_deaths.ReplicaDeaths`), the names they have
    (:class:`~colab_xla.notebook.targets.known_names.KnownNames`). Why the rest is one class
    of more methods than most: start, end, the cell in flight and the verbs between cells
    share one lock and that one cell (the launcher's thread, a cell's and the notebook's meet
    there); split, each part would reach back into the others for them."""

    own_options = (Owned(REPLICA_OPTIONS, (
        "{asked}: this session's replicas were started with their own options ({own}), which "
        "a cell cannot change. Run this cell with --fresh (a one-off run beside the session), "
        "or %xla_session restart with the options you want (%xla_session stop, then "
        "%xla_session start ...)."), SessionError),)
    keeps_replicas = True

    def __init__(self, opts: SessionOptions, plan: ReplicaPlan, directory: str):
        super().__init__()  # (its start_seconds: new_session's)
        self.options, self.plan, self.directory = opts, plan, directory
        self.id = "session-" + secrets.token_hex(6)
        self.processes = processes.RunProcesses(self.id)
        self.replicas: Dict[int, SessionReplica] = {}
        self._last_cell: Optional[CellModule] = None  # (its file is named as its label)
        self._lock = threading.RLock()
        self._commands = CommandPipes(directory)
        # On a cluster's host (started by its agent): where its replicas count globally.
        self._host_rank = HostRank.from_environ(opts.env)
        self._cell: Optional[_CellRun] = None  # the cell running now
        self.deaths = ReplicaDeaths(directory, self.global_ordinal)  # its replicas that died
        self._launcher: Optional[threading.Thread] = None
        self._launch_error: Optional[BaseException] = None
        self._stopping = False  # processes that end from now on were ended on purpose
        # The pipes and rings its replicas write to, from their start to their end (made
        # by start), and their reader between cells (a cell's SessionReplicas borrows them).
        self.pipes = SessionPipes(directory, plan.processes, self._lock,
                                  lambda: self.ended is not None)
        self._modules_dir = directory  # where its cells' files go (see run)
        self._asked = 0  # questions for Tab completion (each its own pipe)

    # -- start and stop ---------------------------------------------------------------------

    @classmethod
    def start(cls, opts: SessionOptions, plan: ReplicaPlan, parent_pid: int,
              cache_dir: Optional[str], user_ns: Mapping[str, Any]) -> "Session":
        """Start the replicas ``plan`` says (``parent_pid``: the replica processes'
        parent, this process or the forkserver; ``cache_dir`` checked) and wait until every
        one is ready; raise :class:`SessionError` (with what they printed) if they cannot."""
        session = cls(opts, plan, state.new_work_dir("session-"))
        os.mkdir(session.cell_dir(), 0o700)
        stop_at_exit(session)
        try:
            session._start(parent_pid, cache_dir, dict(user_ns))
        except BaseException:
            session.end("it did not start")
            raise
        return session

    def _start(self, parent_pid: int, cache_dir: Optional[str], user_ns: Dict[str, Any]) -> None:
        pipes = self.pipes.open()
        self._modules_dir = pipes.directory
        channel, startup = pipes.channel_path, pipes.startup_path
        # (C-level output goes to the start-up pipe until a cell gives each process its
        # own: the processes' ranks are theirs to say)
        job = ReplicaJob(run_id=self.id, run_dir=self.directory, channel_path=channel,
                         parent_pid=parent_pid, fd_paths=((startup, startup),),
                         startup_path=startup, environ=replica_environ(self.plan.env),
                         cache_dir=cache_dir)
        for index in range(self.plan.replicas or 0):  # (others make their own: see serve)
            self._commands.make(index)
        self.processes.begin()
        self._launcher = threading.Thread(target=self._launch, args=(job,), daemon=True,
                                          name="colab_xla-session")
        # The launch's variables (xmp.spawn reads PJRT_DEVICE here) while the replicas
        # start, not for the session's life: the notebook's own environment is the host's.
        launch = self.options.launch
        inherited = (inherit(self.id, user_ns, None, launch.runtime.replaces)
                     if launch.start_method == "fork" else contextlib.nullcontext())
        with inherited, environ(self.plan.env):
            self._launcher.start()
            self._wait_ready()

    def _launch(self, job: ReplicaJob) -> None:
        try:
            start(self.options.launch, serve_replica, job,
                  processes=self.plan.processes if self.plan.own_processes else 0,
                  ended=self._process_ended)
        except BaseException as exc:  # noqa: BLE001 - the session ends, and says why
            self._launch_error = exc
        finally:
            with self._lock:
                if self.ended is None:
                    self.ended = self.deaths.reason or (
                        PROCESSES_ENDED if self._stopping
                        else how_processes_ended(self.processes))
            self._end_cell()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        expected = self.plan.replicas
        while expected is None or len(self.replicas) < expected:
            if self.ended is not None or not self._launcher.is_alive():
                error = self._launch_error
                why = (f"{type(error).__name__}: {error}" if error
                       else self.ended or PROCESSES_ENDED)
                raise SessionError(f"The session's replicas did not start ({why}). "
                                   f"{_DID_NOT_START}" + self._printed())
            if time.monotonic() > deadline:
                raise SessionError(f"The session's replicas did not start within "
                                   f"{START_TIMEOUT_SECONDS:.0f} s. {_DID_NOT_START}"
                                   + self._printed())
            for note in self.pipes.notes(0.2):
                if "ready" in note:
                    index = note["ordinal"]
                    self.replicas[index] = SessionReplica(index, note["ready"], note["rank"])
                    self.processes.track(note["ready"])
                    expected = expected or note.get("world")
        self.processes.stop_adopting()
        for index in self.replicas:
            self._commands.open(index)

    def _printed(self) -> str:
        """What the replicas printed outside a cell (start-up), as the end of a message."""
        printed = self.pipes.printed()
        said = self.deaths.failures_said()
        if printed:
            said += ("\nWhat its replicas printed outside a cell (the last lines):\n"
                     + "\n".join("  " + line for line in printed))
        return said

    def stop(self) -> None:
        """End the session: tell the replicas, then kill whatever is left."""
        self._stopping = True
        self._commands.send_every("stop")
        if self._launcher is not None:
            self._launcher.join(INTERRUPT_GRACE_SECONDS)
        self.end("stopped (%xla_session stop)")

    def end(self, reason: str) -> None:
        """Kill every process of the session (by pid) and remove its files; ``reason``
        is what ``%xla_session`` and the cell say about it."""
        self._stopping = True
        with self._lock:
            if self.ended in (None, PROCESSES_ENDED):
                self.ended = self.deaths.reason or reason
        if self._launcher is not None:
            self.processes.kill_until_ended(self._launcher, KILL_SECONDS)
        else:
            self.processes.kill()
        self._end_cell()
        self._commands.close()
        self.pipes.close()  # (a cell reading them closes them as it ends: give_back)
        shutil.rmtree(self.directory, ignore_errors=True)
        # What its processes left in shared memory (a collectives group's directory: the
        # group is not closed as a replica process ends), once they are gone.
        shared_tensors.prune()
        self._launch_error = None  # (its traceback holds the launcher's frames)

    def check_up(self) -> None:
        """Refuse a cell on a session that has ended, or whose replica died since the
        last cell (the session is ended then), saying why."""
        if self.deaths and self.ended is None:
            self.end(self.deaths.reason)
        if self.ended is not None:
            raise self._ended_error()

    def _ended_error(self) -> SessionError:
        return SessionError(f"The session has ended: {self.ended}. %xla_session start "
                            "starts a new one (%xla_session restart: with the same "
                            "options); --fresh runs one cell without it." + self._printed())

    # -- a cell on the session (the target) --------------------------------------------------

    def repeats(self, flag: str, request: CellRequest) -> bool:
        """A cell may repeat the session's count, start method, launcher, runtime and devices
        per process; its environment, cache, simulation and --debug-single only a new
        session can give."""
        own = self.options.launch
        if flag == "-n":
            return request.replicas == len(self.replicas)
        if flag not in _LAUNCH_PARTS:
            return False
        launch = request.launch.within(own)  # (refuses a launch its runtime cannot make)
        part = _LAUNCH_PARTS[flag]
        return part is not None and getattr(launch, part) == getattr(own, part)

    def describe_own(self) -> str:
        return self.describe_options()

    def run(self, request: CellRequest,
            observer: Optional[RunObserver] = None) -> RunOutcome:
        """Run the cell on the session's replicas, in the globals each keeps from cell to
        cell. A session that ends during the cell says why in ``outcome.session_ended``."""
        self.refuse(request)
        self.check_up()
        options.check_run(replicas=None, timeout=request.timeout, env={}, pull=request.pull,
                          pull_from=request.pull_from, cache_dir=None, launch=Launch())
        options.check_pull_from(request.pull_from, self.plan.replicas)
        chosen = self.chosen(request)
        cell, user_ns = request.cell, request.user_ns
        run_dir = self.cell_dir()
        try:
            module = self._cell_module(cell, request.announce)
            problems = preflight.check(cell, os.environ)
            for problem in problems["fatal"]:
                raise preflight.refusal(problem)
            for problem in problems["notes"]:
                note = said_once(f"colab_xla: {problem.message} {problem.fix}")
                if note and request.announce:
                    request.announce(note)
            if request.hosted is None:
                sent_names, sent = self.known.pack(cell, user_ns)
            else:  # a cluster host's: the notebook chose the names to send (all it sent here)
                sent_names, sent = (names.pack(user_ns, user_ns, names.SESSION) if user_ns
                                    else None), []
            run = RunRequest(self.options.launch, os.getpid(), module, sent_names, None,
                             request.pull, request.pull_from, request.hosted, chosen,
                             began=request.began)
            outcome = Supervisor(run, self.plan, run_dir, dict(user_ns),
                                 observer or RunObserver(), request.timeout,
                                 replicas=SessionReplicas(self), stall=request.stall).run()
            self.known.sent(sent, user_ns)
            self.last_failed, self._last_cell = list(outcome.failed), module
            if not self.up:
                outcome.session_ended = self.ended + self._printed()
            return outcome
        finally:
            _empty(run_dir)

    def _cell_module(self, cell, announce: Optional[Callable[[str], None]]) -> CellModule:
        """The cell written as a module. Its file lives as long as the session (what it
        defines is called later), beside its pipes: in shared memory where there is some
        (making a file in a disk's /tmp costs more). Where that is full, in the session's
        directory from then on, said once."""
        try:
            return CellModule.create(cell, self._modules_dir)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or (
                    self._modules_dir == self.directory):
                raise
            full = self._modules_dir
        self._modules_dir = self.directory
        if announce:
            announce(f"colab_xla: {os.path.dirname(full)} is full: this session's cells are "
                     f"written to {self.directory} from now on; nothing else changes (free "
                     "it, then %xla_session restart, to have them in shared memory again).")
        return CellModule.create(cell, self._modules_dir)

    def cell_dir(self) -> str:
        """The directory every cell of the session runs in (its job; the reports too large
        for a frame and the displays its replicas write), made with the session and
        emptied as each cell ends (not made and removed for every cell: removing a directory
        in a disk's /tmp is slow). Its name is no module's: the
        session's directory is on the replicas' ``sys.path``."""
        return os.path.join(self.directory, "cell-files")

    def chosen(self, request: CellRequest) -> Optional[Tuple[int, ...]]:
        """The replicas ``--targets`` chooses (None: every one), by index; refused
        (:class:`~colab_xla.errors.OptionError`) if one is not the session's."""
        if request.targets is None:
            return None
        return tuple(request.targets.ordinals([(0, i) for i in sorted(self.replicas)]))

    # -- what dies ------------------------------------------------------------------------

    def _process_ended(self, index: int, code: int) -> None:
        """In the launcher thread: replica ``index``'s own process ended."""
        if self._stopping:
            return
        replica = self.replicas.get(index)
        memory = self.processes.memory_note(replica.pid if replica else None)
        with self._lock:
            self.deaths.record(index, code, memory)
            cell = self._cell
        if cell is not None and index not in cell.finished:
            cell.ended(index, code)

    def global_ordinal(self, index: int) -> int:
        """Replica ``index``'s ordinal as the notebook counts it: on a cluster's host
        (started by its agent), counting every host's replicas."""
        rank = self._host_rank
        return index if rank is None else rank.index(index)

    # -- cells ------------------------------------------------------------------------------

    def dispatch(self, job: ReplicaJob, ended: Callable[[int, int], None],
                 over: Callable[[], None]) -> None:
        """Send ``job`` to every replica (the chosen ones: ``--targets``), and return.
        ``over()`` is called once every one has sent its end (by the run's thread, in
        :meth:`finished`), or once the session has ended (by the thread that ended it)."""
        command = job_to_command(job, job.run_dir)
        chosen = sorted(self.replicas) if job.chosen is None else list(job.chosen)
        cell = _CellRun(job.run_id, ended, chosen, over)
        with self._lock:
            if self.ended is not None:
                raise self._ended_error()
            self._cell = cell
            self.cells_run += 1
            # A replica whose death the launcher saw after check_up let the cell through,
            # but before the cell was here to be told: told now, as a death in the cell
            # (it would be waited for forever: it never ends the cell).
            dead = self.deaths.codes()
        try:
            for index, code in dead.items():
                ended(index, code)
            self._commands.send(command, chosen)
        except BaseException:  # (the run says why): the cell is not running
            with self._lock:
                if self._cell is cell:
                    self._cell = None
            raise
        with self._lock:
            ended_meanwhile = self.ended is not None
        if ended_meanwhile or not chosen:
            self._end_cell()

    def finished(self, run_id: str, ordinal: int) -> None:
        with self._lock:
            cell = self._cell
            if cell is None or cell.run_id != run_id:
                return
            cell.finished.add(ordinal)
            if len(cell.finished) < len(cell.chosen):
                return
            self._cell = None
        cell.over()

    def _end_cell(self) -> None:
        """The cell running now (if one is) is over: the session has ended, and its
        replicas that had not ended the cell died with it."""
        with self._lock:
            cell, self._cell = self._cell, None
        if cell is None:
            return
        codes = self.processes.exit_codes() or [-signal.SIGKILL]  # (killed here)
        for index in cell.chosen:
            if index not in cell.finished:
                cell.ended(index, self.deaths.code(index, codes[0]))
        cell.over()

    def still_running(self) -> List[int]:
        """The replicas (global ordinals) that have not ended the cell running now."""
        with self._lock:
            if self._cell is None:
                return []
            return [self.global_ordinal(i) for i in self._cell.chosen
                    if i not in self._cell.finished]

    def debug(self, asked: Optional[int], ask: Callable[[str], str],
              show: Callable[[str], None]) -> str:
        """``%xla_debug``: pdb's post-mortem on replica ``asked``'s last exception (None:
        the lowest replica that failed in the last cell), its prompts asked with ``ask``,
        what it writes shown with ``show`` (:mod:`colab_xla.notebook.debugger`); how it
        ended. The session goes on."""
        if isinstance(asked, tuple):
            raise debugger.DebugError("HOST:R is for a cluster's session: on this machine's, "
                                      "%xla_debug R.")
        self.check_up()
        with self._lock:
            if self._cell is not None:
                raise debugger.DebugError("a cell is running on this session's replicas: "
                                          "%xla_debug runs between cells.")
        ordinal = debugger.chosen(asked, self.last_failed, sorted(self.replicas))
        pipes = [os.path.join(self.directory, f"debug-{name}-{ordinal}")
                 for name in ("answers", "output")]
        for path in pipes:
            os.mkfifo(path, 0o600)
        try:
            self._commands.send("debug " + " ".join(pipes), [ordinal])
            show(debugger.opening(f"replica {ordinal}"))
            cell = self._last_cell
            named = show if cell is None else (  # "> Cell In[3](4)f()", as tracebacks name it
                lambda text: show(text.replace(cell.path, cell.label)))
            return debugger.converse(*pipes, ask=ask, show=named)
        finally:
            for path in pipes:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def names(self, expr: str, timeout: float) -> Optional[List[List[str]]]:
        """The names replica 0 has under ``expr`` (``""``: its globals; ``"model.fc"``: that
        object's attributes), each with its kind: ``[[name, kind], ...]``
        (:mod:`colab_xla.wire.completions`); or None: the session is not up, a cell runs, or
        no answer came within ``timeout`` seconds."""
        with self._lock:
            if (self.ended is not None or self._cell is not None or not self.replicas
                    or (expr and not completions.is_chain(expr))):
                return None
            self._asked += 1
            path = os.path.join(self.directory, f"complete-{self._asked}")
        os.mkfifo(path, 0o600)
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # (see completions.read)
        try:
            self._commands.send(f"complete {path} {expr}", [min(self.replicas)])
            return completions.read(fd, time.monotonic() + timeout)
        finally:
            os.close(fd)
            os.unlink(path)

    def interrupt(self, run_id: str) -> None:
        """KeyboardInterrupt in every replica still running the cell ``run_id``."""
        with self._lock:
            running = (list(self.replicas) if self._cell is None else
                       [i for i in self._cell.chosen if i not in self._cell.finished])
        self._commands.send(f"interrupt {run_id}", running)

    # -- what a person sees -----------------------------------------------------------------

    def describe_options(self) -> str:
        """The options the session was started with, as a line would give them."""
        opts = self.options
        parts = [f"-n {len(self.replicas) or self.plan.replicas}",
                 f"--start-method {opts.launch.start_method}"]
        if opts.launch.runtime != runtimes.get():  # (not the default)
            parts.append(f"--runtime {opts.launch.runtime}")
        if opts.launch.devices_per_process is not None:
            parts.append(f"--devices-per-process {opts.launch.devices_per_process}")
        if self.plan.simulation:
            parts.append(f"--simulate {self.plan.simulation}")
        parts += [f"--env {key}={value}" for key, value in opts.env.items()]
        if opts.cache_dir:
            parts.append(f"--cache {opts.cache_dir}")
        return " ".join(parts)

    def describe_start(self) -> str:
        """What ``%xla_session start`` says once the replicas are up."""
        return (f"colab_xla session: {counted(len(self.replicas), 'replica')} started in "
                f"{self.start_seconds or 0:.2f} s.")  # (forks of a warm process: ms)

    def describe(self) -> str:
        """``%xla_session``'s status text."""
        if self.ended is not None:
            return f"colab_xla session: ended ({self.ended})." + self._printed()
        uptime = time.time() - self.started_at
        device = self.plan.device_type
        if self.plan.simulation:
            device += f", simulated as {self.plan.simulation}"
        replicas = counted(len(self.replicas), "replica")
        lines = [f"colab_xla session: up {uptime:.0f} s, {replicas} on "
                 f"{device}, {counted(self.cells_run, 'cell')} run, "
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
    chosen: List[int]  # the replicas that run it (--targets), by index
    over: Callable[[], None]  # (Session.dispatch)
    finished: set = dataclasses.field(default_factory=set)


def new_session(opts: SessionOptions, user_ns: Mapping, announce=print,
                defaults: Optional[Defaults] = None) -> Session:
    """Start a :class:`Session`, planned and checked as a one-off run is, and refused
    (:class:`colab_xla.errors.SetupError`) as a run is. ``defaults``: the environment's, read
    now if not given."""
    began = time.monotonic()
    launch = opts.launch
    if launch.debug_single:
        raise SessionError("--debug-single runs one replica for one run, so a session "
                           "cannot use it: run the cell with %%xla_spawn --debug-single "
                           "(--fresh while a session is up).")
    defaults = defaults or Defaults.read()
    simulate = opts.simulate or defaults.simulate
    cache_dir = options.check_run(replicas=opts.replicas, timeout=None, env=dict(opts.env),
                                  pull=(), pull_from=None, cache_dir=opts.cache_dir,
                                  launch=launch, simulate=simulate)
    plan, notes = planned(None, replicas=opts.replicas, launch=launch, env=dict(opts.env),
                          simulate=simulate, pull_from=None, defaults=defaults)
    parent_pid = say_notes(plan, launch, notes, announce)
    session = Session.start(opts, plan, parent_pid, cache_dir, user_ns)
    session.start_seconds = time.monotonic() - began
    return session


def _empty(directory: str) -> None:
    """Remove what ``directory`` holds (gone with its session: nothing to do)."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in list(entries):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
