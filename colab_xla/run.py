"""Run a cell on every XLA replica: the notebook side, IPython-free.

:func:`run_cell` writes the cell to a module, starts ``xmp.spawn(..., start_method='fork')``
(or another way, see :mod:`colab_xla.launch`) in a driver thread, and reads the replicas'
frames in the calling thread until the run ends, so the caller (the kernel's main thread)
stays interruptible: on Interrupt (SIGINT) every process the run started is killed by
pid, and the outcome says which replicas were interrupted. The notebook's process never initializes the XLA
runtime and never runs a replica.

Example (in a plain Python process with torch_xla installed)::

    >>> outcome = run_cell("print('hi from', index)\\nindex * 10", nprocs=2)
    >>> outcome.results()
    {0: 0, 1: 10}
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import json
import math
import multiprocessing
import multiprocessing.managers
import os
import re
import secrets
import select
import shutil
import signal
import tempfile
import threading
import time
import traceback
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import psutil

from . import hardware, interrupts, preflight, processes, state
from .replica import job as replica_job
from .replica.process import inherit
from .transport import frames, names, shared_tensors, values
from .cell import CellModule
from .launch import Launch, environ, replica_environ, start, warm_forkserver
from .options import is_name
from .outcome import (DONE, FAILED, KILLED, RETURN_PLAIN_DATA, ReplicaError, RunObserver,
                      RunOutcome)

# Live views draw every TICK_SECONDS while output flows (a few updates a second keep the
# browser responsive), and FIRST_DRAW_SECONDS after the first output of a quiet spell.
TICK_SECONDS = 0.25
FIRST_DRAW_SECONDS = 0.05
# After a kill, how long to wait for the driver thread to see its pool broken.
_DRIVER_JOIN_SECONDS = 5.0
# Once a replica has failed, how long the others may go on before the run is stopped:
# they are usually blocked in a collective waiting for it and would wait forever
# (pytorch/xla#7974).
FAIL_FAST_SECONDS = 3.0


# The output source of replica processes before their replicas start (see _Run.run).
STARTUP, STARTUP_LABEL = -1, "process start-up"


class RuntimeInitializedError(preflight.PreflightError):
    """The notebook's process already initialized XLA; replicas cannot start."""


def run_cell(source: str, *, nprocs: Optional[int] = None, user_ns: Optional[Mapping] = None,
             label: str = "cell", header: str = "# %%xla_spawn",
             observer: Optional[RunObserver] = None, announce=print,
             timeout: Optional[float] = None, launch: Launch = Launch(),
             env: Optional[Mapping[str, str]] = None, cache_dir: Optional[str] = None,
             pull: Sequence[str] = (), pull_from: Optional[int] = None) -> RunOutcome:
    """Run ``source`` on every replica and return the :class:`RunOutcome`.

    ``launch`` says how replicas start (start method, launcher, one-replica debugging);
    ``env`` adds variables for the replicas only (the replica count and device are
    planned with them); ``cache_dir`` turns on torch_xla's persistent compilation cache,
    a sub-directory per replica process; ``pull`` names are sent back from every replica
    (or only from replica ``pull_from``) into ``outcome.pulled(name)``.

    The run ends when every replica has ended; or :data:`FAIL_FAST_SECONDS` after the
    first replica failed; or after ``timeout`` seconds; or on Interrupt (SIGINT). Then
    every process it started is killed, and replicas still running are ``killed`` with the
    reason, their last output line and their last ``xm.rendezvous`` tag.

    Raises before anything starts, with a message that says what to do:
    ``EmptyCellError``, ``SyntaxError`` (with the cell's line), ``ReplicaCountError``,
    ``TorchXlaMissing``, ``ValueError`` (a bad option), ``PreflightError`` (SPMD on, a
    cell that spawns replicas itself, the TPU held by another process, names that cannot be
    sent to a replica that does not fork) and its kind :class:`RuntimeInitializedError`. Failures of replicas are not raised:
    they are in the outcome (see ``outcome.failed``).
    """
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):  # nan > 0 is False
        raise ValueError(f"--timeout {timeout:g}: the timeout must be more than 0 seconds and "
                         "finite; leave -t out to run without one.")
    env = dict(env or {})
    check_options(env, pull, pull_from)
    if cache_dir is not None:
        cache_dir = _cache_dir(cache_dir)
    if launch.debug_single and nprocs not in (None, 1):
        raise ValueError(f"-n {nprocs} with --debug-single: it runs one replica; leave -n out.")
    user_ns = dict(user_ns or {})
    run_dir = tempfile.mkdtemp(prefix="colab_xla-")  # mode 0700, unpredictable name
    try:
        cell = CellModule.create(source, run_dir, label=label, header=header)
        replica_env = replica_environ(env)  # what the replicas will see, --env included
        hw = hardware.detect(replica_env)
        plan = hardware.plan_replicas(nprocs, hw)
        if launch.debug_single:  # one replica, one process, whatever the host has
            if plan.device_type == "CPU":
                plan = hardware.plan_replicas(1, hw)
            plan = dataclasses.replace(plan, replicas=1, processes=1)
        if pull_from is not None and plan.replicas is not None and pull_from >= plan.replicas:
            raise ValueError(f"--pull-from {pull_from}: this run has {plan.replicas} "
                             f"replica{'s' if plan.replicas != 1 else ''} (0-{plan.replicas - 1}); "
                             "give one of those ordinals.")
        hardware.import_torch_xla()
        problems = preflight.check(source, replica_env, launch, plan.device_type)
        for problem in problems["fatal"]:
            error = (RuntimeInitializedError if problem.code == "runtime-initialized"
                     else preflight.PreflightError)
            raise error(problem)
        sent_names = None
        if launch.start_method != "fork":
            sent_names = names.pack(names.used_names(source, user_ns), user_ns,
                                   launch.start_method)
        # Notes are said once per notebook process (leftover processes: every run).
        notes = [_once(plan.note), _once(_start_note(launch))]
        parent_pid = os.getpid()  # of the replica processes (each checks it)
        if launch.start_method == "forkserver":
            parent_pid, started = warm_forkserver()
            if started:
                notes.append(FORKSERVER_STARTING)
        notes += [_once(f"colab_xla: {p.message} {p.fix}") for p in problems["notes"]]
        leftovers = preflight.leftovers_problem(processes.leftovers())
        if leftovers:  # said on every run until they are gone
            notes.append(f"colab_xla: {leftovers.message} {leftovers.fix}")
        for note in filter(None, notes):
            if announce:
                announce(note)
        changes = {**env, **plan.env, **preflight.topology_changes(replica_env, plan.env)}
        plan = dataclasses.replace(plan, env=changes)
        options = _Options(launch, parent_pid, cell, sent_names,
                           cache_dir, tuple(pull), pull_from)
        return _Run(options, plan, run_dir, user_ns, observer or RunObserver(),
                    timeout).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def check_options(env: Mapping[str, str], pull: Sequence[str],
                  pull_from: Optional[int]) -> None:
    """Bad ``env``, ``pull`` or ``pull_from`` values, as a ValueError that says why."""
    for key, value in env.items():
        if not _ENV_NAME.fullmatch(key) or not isinstance(value, str):
            raise ValueError(f"--env {key}={value}: KEY must be letters, digits and '_' "
                             "(not starting with a digit), VALUE a string.")
    for name in pull:
        if not is_name(name):
            raise ValueError(f"--pull {name}: each NAME must be a Python identifier (not a "
                             "keyword).")
    if pull_from is not None and (pull_from < 0 or not pull):
        raise ValueError(f"--pull-from {pull_from}: give a replica ordinal (0 or more) "
                         "together with --pull NAME.")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _cache_dir(path: str) -> str:
    """``--cache DIR`` made (if new) and checked writable here, before replicas need it."""
    if not path.strip():  # abspath("") would be the notebook's working directory
        raise ValueError("--cache '': give a directory (--cache ~/xla_cache), or leave "
                         "--cache out to compile without the cache.")
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--cache {path}: cannot create it ({exc.strerror}); choose "
                         "another DIR.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--cache {path}: not writable by this user; choose another DIR.")
    return path


@dataclasses.dataclass(frozen=True)
class _Options:
    """What a run does besides running the cell (see :func:`run_cell`)."""

    launch: Launch
    parent_pid: int  # the replica processes' parent: this process, or the forkserver
    cell: CellModule
    names: Optional[bytes]  # without fork: the notebook names the cell uses, pickled
    cache_dir: Optional[str]
    pull: Tuple[str, ...]
    pull_from: Optional[int]


def _start_note(launch: Launch) -> Optional[str]:
    if launch.debug_single:
        return ("colab_xla: --debug-single runs one replica (index 0) in a process of its "
                "own, through torch_xla.launch(debug_single_process=True).")
    if launch.start_method == "spawn":
        return ("colab_xla: --start-method spawn starts fresh interpreters, which import "
                "torch and torch_xla on every run (seconds); --start-method forkserver "
                "imports them once and then starts replicas about as fast as fork.")
    return None


FORKSERVER_STARTING = ("colab_xla: starting the forkserver: it imports torch and torch_xla "
                       "once (a few seconds; this run waits for it), then replicas fork from "
                       "it warm.")


def _once(note: Optional[str]) -> Optional[str]:
    """``note`` the first time this notebook process sees it, else None."""
    if note is None or note in _said:
        return None
    _said.add(note)
    return note


_said: set = set()  # notes said once per notebook process


class _Run:
    def __init__(self, options: _Options, plan: hardware.ReplicaPlan, run_dir: str,
                 user_ns: Dict[str, Any], observer: RunObserver, timeout: Optional[float]):
        self.options, self.cell = options, options.cell
        self.plan, self.run_dir, self.observer = plan, run_dir, observer
        self.timeout = timeout
        self._timeout_at = time.monotonic() + timeout if timeout else None
        self._fail_at: Optional[float] = None
        self._first_failed: Optional[int] = None
        self._stop: Optional[str] = None  # why the run was cut: interrupted, timeout, failed
        self.user_ns = user_ns
        self.run_id = secrets.token_hex(8)
        self.outcome = RunOutcome(device_type=plan.device_type, log_dir=state.new_log_dir())
        self._record = processes.RunRecord(self.run_id)
        self._decoders: Dict[tuple, Any] = {}
        self._ranks: Dict[int, set] = {}  # local process rank -> ordinals it runs
        self._pid_rank: Dict[int, int] = {}
        self._processes: Dict[int, psutil.Process] = {}
        self._children_before: set = set()
        self._children: Dict[int, multiprocessing.process.BaseProcess] = {}
        self._driver_error: Optional[BaseException] = None
        self._output_since_draw = False
        self._exits: Dict[int, Tuple[int, int]] = {}  # pid -> (replica, code) of os._exit
        self._interrupts = interrupts.Interrupts(None)  # held while the run goes on
        self._decoder = frames.FrameDecoder()  # (an Interrupt may come before reading starts)

    # -- the run --------------------------------------------------------------------------

    def run(self) -> RunOutcome:
        self._started = time.monotonic()
        opts = self.options
        channel_path = os.path.join(self.run_dir, "channel")
        read_fd, write_fd = frames.make_fifo(channel_path)
        done_r, done_w = os.pipe()
        fd_paths = [tuple(os.path.join(self.run_dir, f"process-{rank}.{kind}")
                          for kind in ("stdout", "stderr"))
                    for rank in range(self.plan.processes)]
        fd_pipes = [tuple(frames.make_fifo(path) for path in pair) for pair in fd_paths]
        self._fd_sources = {pipe[0]: (rank, kind)
                            for rank, pair in enumerate(fd_pipes)
                            for kind, pipe in zip((frames.STDOUT, frames.STDERR), pair)}
        # What a replica process prints before its rank is known (torch_xla starting its
        # runtime: XLA's fatal message for a bad XLA_FLAGS, say) goes to one more pipe.
        startup_path = os.path.join(self.run_dir, "startup")
        startup = frames.make_fifo(startup_path)
        self._fd_sources[startup[0]] = (STARTUP, frames.STDERR)
        fd_pipes.append((startup,))
        self._shm_dir = shared_tensors.make_dir(self.run_id)
        # A Manager lock costs ~5 ms of connections per run: only cells that use it pay.
        lock = _lock_manager().Lock() if "lock" in self.cell.source else None
        # Taken after the manager exists: every child that appears from now on is ours.
        self._children_before = set(multiprocessing.active_children())
        forked = opts.launch.start_method == "fork"
        job = replica_job.ReplicaJob(
            run_id=self.run_id, run_dir=self.run_dir, channel_path=channel_path,
            parent_pid=opts.parent_pid, lock=lock, fd_paths=tuple(fd_paths),
            startup_path=startup_path,
            environ=replica_environ(self.plan.env),
            cell=None if forked else self.cell, names=None if forked else opts.names,
            cache_dir=opts.cache_dir, pull=opts.pull, pull_from=opts.pull_from,
            shm_dir=self._shm_dir)
        driver = threading.Thread(target=self._drive, args=(job, done_w),
                                  name="colab_xla-driver", daemon=True)
        # From here on an Interrupt is a flag the read loop checks (see colab_xla.interrupts):
        # a second one during the clean-up cannot break it either.
        inherited = (inherit(self.run_id, self.user_ns, self.cell) if forked
                     else contextlib.nullcontext())
        with inherited, interrupts.held() as self._interrupts:
            try:
                self.observer.opened(self.outcome)
                driver.start()
                try:
                    self._read_until_done(read_fd, done_r)
                except KeyboardInterrupt:  # raised by a view's own code: an Interrupt too
                    self._interrupts.requested = True
                if self._interrupts.requested:
                    self.outcome.interrupted = True
                    self._cut("interrupted", read_fd)
                if self._stop:
                    self._stop_processes(driver)
                else:
                    driver.join()
                self._drain(read_fd)
                self._settle_unreported()
                if (self._driver_error is not None and not self.outcome.replicas
                        and not self._stop):
                    self.outcome.launch_error = _launch_error(self._driver_error)
                # Replicas arrive in any order; the outcome a person reads is by ordinal.
                self.outcome.replicas = dict(sorted(self.outcome.replicas.items()))
            finally:
                self._kill_processes()  # nothing of the run outlives it, whatever happened
                if driver.is_alive():  # an error above: let it see its pool end first
                    driver.join(_DRIVER_JOIN_SECONDS)
                shared_tensors.remove_dir(self._shm_dir)  # tensors already mapped stay valid
                for fd in (read_fd, write_fd, done_r, done_w,
                           *(fd for pair in fd_pipes for pipe in pair for fd in pipe)):
                    os.close(fd)
                self.outcome.elapsed = time.monotonic() - self._started
                self._finish_logs()
                # Its traceback's frames hold the pool (each process's sentinel pipe) and this
                # run: a cycle that kept those fds open until a garbage collection.
                self._driver_error = None
        return self.outcome

    def _drive(self, job: replica_job.ReplicaJob, done_w: int) -> None:
        try:
            with environ(self.plan.env):
                start(self.options.launch, replica_job.main, job)
        except BaseException as exc:  # noqa: BLE001 - reported through the outcome
            self._driver_error = exc  # (let go of when the run ends: see run)
        finally:
            os.write(done_w, b"x")

    def _read_until_done(self, read_fd: int, done_r: int) -> None:
        fds = [read_fd, done_r, *self._fd_sources]
        if self._interrupts.wake_fd is not None:
            fds.append(self._interrupts.wake_fd)
        next_tick = time.monotonic() + TICK_SECONDS
        quiet = True  # the last draw showed no new output: new output is drawn soon
        while True:
            if self._interrupts.requested:
                return
            now = time.monotonic()
            for reason, at in (("timeout", self._timeout_at), ("failed", self._fail_at)):
                if at is not None and now >= at:
                    self._cut(reason, read_fd)
                    return
            wake = min(t for t in (next_tick, self._timeout_at, self._fail_at) if t is not None)
            readable, _, _ = select.select(fds, [], [], max(0.0, wake - now))
            for fd in readable:
                if fd not in (done_r, self._interrupts.wake_fd):
                    self._read(fd, read_fd)
            if self._output_since_draw and quiet:
                # First output after a quiet spell: draw it soon (with what the other
                # replicas print in the same moment), not a whole tick later.
                next_tick, quiet = min(next_tick, time.monotonic() + FIRST_DRAW_SECONDS), False
            if time.monotonic() >= next_tick:
                self._track_descendants()
                self.observer.tick(self.outcome)
                quiet, self._output_since_draw = not self._output_since_draw, False
                next_tick = time.monotonic() + TICK_SECONDS
            if readable == [done_r]:
                return  # the driver ended and the pipes hold nothing more right now

    def _cut(self, reason: str, read_fd: int) -> None:
        """Stop the run now: what the pipes hold was written before this moment and counts
        (a replica that reported its end in time is done); a report read after it is late
        and ignored, so the replica is settled as stopped for ``reason``, even if the kill
        comes too late to stop it (a --timeout shorter than the start-up)."""
        for fd in [read_fd, *self._fd_sources]:
            if select.select([fd], [], [], 0)[0]:
                self._read(fd, read_fd)
        self._stop = reason

    def _stop_processes(self, driver: threading.Thread) -> None:
        """Kill the run's processes until the driver has seen its pool end: the pool may
        still be starting replicas when the run is stopped (a short --timeout)."""
        deadline = time.monotonic() + _DRIVER_JOIN_SECONDS
        while True:
            self._kill_processes()
            driver.join(0.05)
            if not driver.is_alive() or time.monotonic() >= deadline:
                return

    def _read(self, fd: int, read_fd: int) -> bool:
        """Read what ``fd`` has; False at end of file."""
        data = os.read(fd, 1 << 16)
        if fd == read_fd:
            self._handle_all(self._decoder.feed(data))
        elif data:
            rank, kind = self._fd_sources[fd]
            self._text(self._fd_owner(rank), kind, data)
        return bool(data)

    def _drain(self, read_fd: int) -> None:
        # Every replica process has exited: what they wrote is in the pipes already.
        for fd in [read_fd, *self._fd_sources]:
            while select.select([fd], [], [], 0)[0] and self._read(fd, read_fd):
                pass
        for (source, kind), dec in self._decoders.items():
            self._emit(source, kind, dec.decode(b"", final=True))

    def _fd_owner(self, rank: int):
        """C-level output of a process belongs to its replica if it runs only one."""
        if rank == STARTUP:
            return STARTUP_LABEL
        ordinals = self._ranks.get(rank, ())
        per_process = (self.plan.replicas or 0) // max(1, self.plan.processes)
        if len(ordinals) == 1 and per_process == 1:
            return next(iter(ordinals))
        return f"process {rank}"

    # -- frames -----------------------------------------------------------------------------

    def _handle_all(self, batch: List[frames.Frame]) -> None:
        # Consecutive output of one replica is handled as one chunk: a chatty replica
        # sends a frame per line, and per-frame work would cap throughput.
        run: List[frames.Frame] = []
        for frame in batch:
            if run and (frame.kind, frame.ordinal, frame.pid) != (run[0].kind, run[0].ordinal, run[0].pid):
                self._handle(run[0]._replace(payload=b"".join(f.payload for f in run)))
                run = []
            if frame.kind in frames.STREAMS:
                run.append(frame)
            else:
                self._handle(frame)
        if run:
            self._handle(run[0]._replace(payload=b"".join(f.payload for f in run)))

    def _handle(self, frame: frames.Frame) -> None:
        if frame.kind in frames.STREAMS:
            source = frame.ordinal
            if source < 0:  # a thread of the process that is not a replica
                source = f"process {self._pid_rank.get(frame.pid, '?')}"
            self._text(source, frame.kind, frame.payload)
        elif frame.kind == frames.START:
            info = json.loads(frame.payload)
            rep = self.outcome.replica(frame.ordinal)
            rep.pid = frame.pid
            self._pid_rank[frame.pid] = info["rank"]
            self._ranks.setdefault(info["rank"], set()).add(frame.ordinal)
            self._track(frame.pid)
            self._new_children()
            self.observer.started(self.outcome, frame.ordinal)
        elif frame.kind == frames.END:
            if self._stop:  # it ended after the run was stopped: not in time (see _cut)
                return
            self._load_report(frame.ordinal)
            if self.outcome.replicas[frame.ordinal].error and self._fail_at is None:
                self._first_failed = frame.ordinal
                self._fail_at = time.monotonic() + FAIL_FAST_SECONDS
            self.observer.finished(self.outcome, frame.ordinal)
        elif frame.kind == frames.NOTE:
            note = json.loads(frame.payload)
            if "rendezvous" in note:
                self.outcome.replica(frame.ordinal).last_rendezvous = note["rendezvous"]
            if "exit" in note:  # os._exit: the process ends now, with its replicas
                self._exits[note["pid"]] = (frame.ordinal, note["exit"])

    def _text(self, source, kind: int, data: bytes) -> None:
        key = (source, kind)
        dec = self._decoders.get(key)
        if dec is None:
            dec = self._decoders[key] = codecs.getincrementaldecoder("utf-8")("replace")
        self._emit(source, kind, dec.decode(data))

    def _log(self, source):
        return (self.outcome.replica(source).log if isinstance(source, int)
                else self.outcome.process(source))

    def _emit(self, source, kind: int, text: str) -> None:
        if text:
            self._output_since_draw = True
            lines = self._log(source).write(frames.STREAMS[kind], text)
            self.observer.output(self.outcome, source, lines)

    def _finish_logs(self) -> None:
        for source in [*self.outcome.replicas, *self.outcome.processes]:
            lines = self._log(source).finish()
            if lines:
                self.observer.output(self.outcome, source, lines)

    def _load_report(self, ordinal: int) -> None:
        rep = self.outcome.replica(ordinal)
        report = values.read_report(self.run_dir, ordinal)
        # Wall time as the person waiting sees it: from the run's start (fork, runtime
        # start-up included) to this replica's report.
        rep.elapsed = time.monotonic() - self._started
        rep.error, rep.value_repr = report.error, report.value_repr
        problems = []
        if report.value is not None:
            try:
                rep.value, rep.has_value = values.load_value(report.value, self.user_ns), True
            except Exception as exc:  # noqa: BLE001
                problems.append(f"the cell's value arrived but could not be loaded in the "
                                f"notebook: {type(exc).__name__}: {exc}")
        for name, data in report.pulled.items():
            try:
                rep.pulled[name] = values.load_value(data, self.user_ns)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"--pull {name} arrived but could not be loaded in the "
                                f"notebook: {type(exc).__name__}: {exc}")
        if problems:  # with what the replica itself could not send, if anything
            rest = f"; {rep.error.evalue}" if rep.error else ". " + RETURN_PLAIN_DATA
            rep.error = ReplicaError("result", "ResultError", "; ".join(problems) + rest)
        rep.state = FAILED if rep.error else DONE

    def _settle_unreported(self) -> None:
        """Replicas that never sent a report: interrupted, or their process died."""
        expected = range(self.plan.replicas) if self.plan.replicas else ()
        for ordinal in sorted(set(expected) | set(self.outcome.replicas)):
            rep = self.outcome.replica(ordinal)
            if rep.state in (DONE, FAILED):
                continue
            where = _whereabouts(rep)
            if self._stop:
                rep.state, rep.elapsed = KILLED, time.monotonic() - self._started
            if self._stop == "interrupted":
                rep.error = ReplicaError("interrupted", "KeyboardInterrupt",
                                         "interrupted while running", where=where)
            elif self._stop == "timeout":
                rep.error = ReplicaError("timeout", "Timeout",
                                         f"still running after --timeout {self.timeout:g} s, so "
                                         "the run was stopped", where=where)
            elif self._stop == "failed":
                first = self.outcome.replicas[self._first_failed]
                rep.error = ReplicaError(
                    "stopped", "Stopped",
                    f"stopped {FAIL_FAST_SECONDS:g} s after replica {self._first_failed} "
                    f"failed ({first.error.ename})", where=where)
            else:
                rep.state = FAILED
                rep.error = ReplicaError("died", "ReplicaDied", self._death_reason(rep))

    def _death_reason(self, rep) -> str:
        pid = rep.pid
        if pid is None and self.plan.processes == 1 and self._exits:
            pid = next(iter(self._exits))  # it never started: its process is the one
        if pid in self._exits:
            ordinal, code = self._exits[pid]
            same = "" if ordinal == rep.ordinal else (
                f" (replica {rep.ordinal} ran as a thread of that process, so it ended too)")
            return (f"replica {ordinal} called os._exit({code}), which ended its process "
                    f"(exit code {code}) before the cell finished{same}. Let the cell end "
                    "instead (or sys.exit(), which ends only that replica).")
        self._new_children()
        for p in self._children.values():
            p.join(0)  # sets exitcode if the process is gone
        codes = sorted({p.exitcode for p in self._children.values() if p.exitcode})
        how = ", ".join(_describe_exit(c) for c in codes)
        said = native_crash([rep.log, *self.outcome.processes.values()])
        if said is not None:
            signal_name, message = said
            how = how or (f"killed by {signal_name}" if signal_name else "")
            if message:
                return (f"the replica's process ended before the cell finished: "
                        f"{how or 'a native crash'}; XLA said: {message!r}. Fix what it names "
                        "(a flag in XLA_FLAGS or --env, say) and run the cell again; the "
                        "process output has the rest (and the stack of every thread).")
        cause = f" ({type(self._driver_error).__name__}: {self._driver_error})" \
            if self._driver_error else ""
        return (f"the replica's process ended before the cell finished: "
                f"{how or 'without an exit code'}{cause}. Its last output is above; a crash "
                "in native code (SIGSEGV, SIGABRT) usually leaves XLA's own message in the "
                "process output or the full logs.")

    # -- processes ---------------------------------------------------------------------------

    def _new_children(self) -> List[multiprocessing.process.BaseProcess]:
        """Processes started since the run began (the pool's); remembered, so that their
        exit codes can be told after they are reaped."""
        for p in multiprocessing.active_children():
            if p not in self._children_before:
                self._children.setdefault(p.pid, p)
        return [p for p in self._children.values() if p.exitcode is None]

    def _track(self, pid: int) -> None:
        if pid not in self._processes:
            with contextlib.suppress(psutil.Error):
                self._processes[pid] = psutil.Process(pid)
                self._record.add(self._processes[pid])

    def _track_descendants(self) -> None:
        """Record the pool's processes and what they started (a DataLoader's workers, a
        subprocess in its own session): all killed with the run, all in the pid registry."""
        for child in self._new_children():
            self._track(child.pid)
        for proc in list(self._processes.values()):
            with contextlib.suppress(psutil.Error):
                for descendant in proc.children(recursive=True):
                    self._track(descendant.pid)

    def _kill_processes(self) -> None:
        """SIGKILL every process this run started (by pid, never by name) and reap them."""
        children = self._new_children()
        for child in children:
            self._track(child.pid)
        victims: List[psutil.Process] = []
        for proc in list(self._processes.values()):
            with contextlib.suppress(psutil.Error):
                victims.extend(proc.children(recursive=True))
                victims.append(proc)
        for proc in victims:
            with contextlib.suppress(psutil.Error):
                proc.kill()  # psutil refuses if the pid now belongs to another process
        # The pool's processes are reaped by multiprocessing, not by psutil: a child that
        # psutil's waitpid reaped stays in multiprocessing's own list for good (its poll
        # sees ECHILD as "still running"), and with it the pipe fd of its sentinel - one
        # leaked fd per replica process of every interrupted or timed-out run.
        deadline = time.monotonic() + 3
        for child in children:
            child.join(max(0.0, deadline - time.monotonic()))
        ours = {child.pid for child in children}
        gone, alive = psutil.wait_procs([p for p in victims if p.pid not in ours],
                                        timeout=max(0.0, deadline - time.monotonic()))
        alive += [child for child in children if child.exitcode is None]
        self._processes.clear()
        if not alive:
            self._record.close()


# An absl/glog fatal line, as XLA and libtpu write it before they abort:
# "2026-11-23 10:16:28.249609: F external/xla/...cc:234] Unknown flag in XLA_FLAGS: --x"
# or "F1123 10:16:28.249609  1234 file.cc:234] Check failed: ...".
_FATAL_LINE = re.compile(r"(?:^|: )F(?:\d{4} [\d:.]+\s+\d+)?\s+[\w./-]+:\d+\]\s+(?P<message>.+)$")
# Python's faulthandler names the signal (enabled in every replica process).
_FAULTHANDLER = {"Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS",
                 "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}


def native_crash(logs) -> Optional[Tuple[Optional[str], Optional[str]]]:
    """``(signal name, XLA's fatal message)`` found in the output of a process that
    crashed in native code, or None: from the first fatal line and the faulthandler
    header ("Fatal Python error: Aborted")."""
    signal_name = message = None
    for log in logs:
        for _, line in log.tail:
            if message is None:
                found = _FATAL_LINE.search(line)
                if found:
                    message = found.group("message")[:300]
            if signal_name is None and line.startswith("Fatal Python error: "):
                signal_name = _FAULTHANDLER.get(line[len("Fatal Python error: "):].strip())
    return (signal_name, message) if signal_name or message else None


def _launch_error(exc: BaseException) -> ReplicaError:
    """xmp.spawn failed before any replica started: its exception, as data."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ReplicaError("launch", type(exc).__name__, str(exc) or repr(exc), text)


def _whereabouts(rep) -> str:
    """Where a replica was when the run was cut: its last line, its last rendezvous."""
    lines = rep.log.tail_text().rsplit("\n", 1)
    parts = []
    if lines[-1]:
        parts.append(f"last output: {lines[-1][:200]!r}")
    if rep.last_rendezvous is not None:
        parts.append(f"last xm.rendezvous: {rep.last_rendezvous!r}")
    return "; ".join(parts) if parts else "no output yet"


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# --- the lock shared by replicas -------------------------------------------------------------

_manager: Optional[multiprocessing.managers.SyncManager] = None


def _lock_manager() -> multiprocessing.managers.SyncManager:
    """A Manager kept for the kernel's life: starting one costs ~30 ms, a lock ~1 ms."""
    global _manager
    if _manager is None or not _manager._process.is_alive():
        _manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("fork"))
        _manager.start(_manager_process_init, (os.getpid(),))
    return _manager


def _manager_process_init(parent_pid: int) -> None:
    # The notebook's Interrupt reaches its whole process group; the manager must outlive it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    processes.die_with_parent(parent_pid)


def shutdown() -> None:
    """Stop the lock manager (on ``%unload_ext colab_xla``)."""
    global _manager
    if _manager is not None:
        with contextlib.suppress(Exception):
            _manager.shutdown()
        _manager = None
