"""The run loop, on the notebook's side: one :class:`Supervisor` per run, and its
:class:`RunRequest`.

The Supervisor composes what a run needs, each from the module that owns it: it reads the
run's pipes (:class:`colab_xla.notebook.pipes.RunPipes`, made for the run or lent by a
session), starts the replicas
(:class:`colab_xla.notebook.replicas.Replicas`: fresh ones, or a session's) in a driver
thread, and reads every pipe in the calling thread (the kernel's main thread, so it stays
interruptible) until the replicas have ended: frames become the outcome's output lines,
starts, reports and notes, and the observer (a view) hears of each, drawing when
:class:`colab_xla.notebook.draw_pacing.DrawPacer` says (C-level output a line at a time:
:mod:`colab_xla.notebook.partial_lines`). It cuts the run on Interrupt, ``--timeout`` or
:data:`colab_xla.notebook.deadlines.FAIL_FAST_SECONDS` after a replica failed
(:class:`colab_xla.notebook.deadlines.Deadlines`), settles every replica that sent no report
(:mod:`colab_xla.notebook.endings`), and leaves nothing of the run running whatever happened.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import json
import os
import itertools
import secrets
import select
import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from . import draw_pacing, endings, interrupts, shared_lock, state
from ..errors import SetupError
from ..wire.cell import CellModule
from .deadlines import Deadlines
from .draw_pacing import DrawPacer
from .launch import Launch, inherit, replica_environ
from .outcome import DONE, FAILED, STOPPED, RunObserver, RunOutcome, Stall, load_results
from .partial_lines import PartialLines
from .pipes import STARTUP, STARTUP_LABEL, RunPipes
from .replicas import FreshReplicas, Replicas
from ..wire.job import ReplicaJob
from ..wire import displays, frames, shared_tensors, stacks, values
from ..runtimes.plan import ReplicaPlan

_runs = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """What a run does besides running the cell (see
    :func:`colab_xla.notebook.targets.one_off.run_cell`)."""

    launch: Launch
    parent_pid: int  # the replica processes' parent: this process, or the forkserver
    cell: CellModule
    names: Optional[bytes]  # without fork: the notebook names the cell uses, pickled
    cache_dir: Optional[str]
    pull: Tuple[str, ...]
    pull_from: Optional[int]
    # A run a cluster's host agent runs for the notebook (colab_xla.notebook.cluster.agent): values
    # and --pull names stay packed (the notebook loads them: its classes are there), large
    # tensors do not go through this host's shared memory, and the agent interrupts it.
    hosted: Optional[interrupts.Remote] = None
    # The replicas that run the cell (a session's, by ordinal: --targets); None: all.
    chosen: Optional[Tuple[int, ...]] = None
    # When the cell asked to run (time.monotonic(): CellRequest.began); None: at run().
    began: Optional[float] = None


class _Driver:
    """What drives a run's replicas (:meth:`Replicas.drive`): a thread of its own, or the
    run's own thread for replicas that are only sent the cell (:attr:`Replicas.threaded`).
    It is alive until the drive calls :meth:`over`, which wakes the run's read loop
    (``done_w``); a thread, until it ends too. Once :meth:`close`d, ``over`` writes nothing
    (``done_w`` is closed with the run's pipes)."""

    def __init__(self, target: Callable[[], None], done_w: int, threaded: bool):
        self._target, self._done_w = target, done_w
        self._over = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = (threading.Thread(target=target, name="colab_xla-driver", daemon=True)
                        if threaded else None)

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()
        else:
            self._target()

    def over(self) -> None:
        """Every replica has ended the run (or it cannot go on): once, whoever calls."""
        with self._lock:
            if self._over.is_set() or self._closed:
                return
            self._over.set()
            os.write(self._done_w, b"x")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            # (its target is the run's method: a cycle that kept the run, its outcome and
            # the values the replicas sent until a garbage collection)
            self._target = None

    def is_alive(self) -> bool:
        if self._thread is not None:
            return self._thread.is_alive()
        return not self._over.is_set()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._over.wait(timeout)


class Supervisor:
    """One run, from the notebook's side: start the replicas (in a driver thread; a
    session's are sent the cell), read what they send until they end (or the run is cut),
    settle every replica in the outcome, and leave nothing running. Call :meth:`run`
    once.

    Why one class of more methods than most: they are one run's event switch
    (:meth:`_handle`) and its handlers, over what every handler shares (the outcome, the
    decoders, the held lines, the logs); the run's parts that stand alone are objects of
    their own already (its deadlines, its replicas, its pipes, the held lines, the draw
    pacing)."""

    def __init__(self, options: RunRequest, plan: ReplicaPlan, run_dir: str,
                 user_ns: Dict[str, Any], observer: RunObserver, timeout: Optional[float],
                 replicas: Optional[Replicas] = None, stall: Optional[float] = None):
        self.options, self.cell = options, options.cell
        self.plan, self.run_dir, self.observer = plan, run_dir, observer
        self.timeout = timeout
        self.user_ns = user_ns
        self.run_id = f"{secrets.token_hex(4)}{next(_runs):08x}"
        self.outcome = RunOutcome(device_type=plan.device_type, log_dir=state.next_log_dir())
        if options.began is not None:
            self.outcome.began = options.began
        if options.chosen is not None and plan.replicas:
            self.outcome.idle = sorted(set(range(plan.replicas)) - set(options.chosen))
        self._decoders: Dict[tuple, Any] = {}
        self._held = PartialLines()  # unended C-level lines, by the pipe they came from
        self._ranks: Dict[int, set] = {}  # local process rank -> ordinals it runs
        self._pid_rank: Dict[int, int] = {}
        self._replicas = replicas or FreshReplicas(self.run_id, options.launch, plan)
        # The run's deadlines and why it was cut: also when a replica has not started the
        # cell within its replicas' bound (Replicas.start_seconds).
        self._deadlines = Deadlines(timeout, time.monotonic(),
                                    start=self._replicas.start_seconds,
                                    replicas=self._expected())
        self._driver_error: Optional[BaseException] = None
        self._output_since_draw = False
        self._exits: Dict[int, Tuple[int, int]] = {}  # pid -> (replica, code) of os._exit
        self._died: Dict[int, int] = {}  # replica -> exit code of its own process
        # replica -> (pid, thread ident, its process's stacks file), from its start
        self._threads: Dict[int, Tuple[int, int, str]] = {}
        self._places: Dict[int, str] = {}  # replica -> where it was when the run was cut
        self._asked_where = None  # the stacks asked for then, to read once stopped (_cut)
        # After this many seconds without output, the live view is told where each replica
        # is (again every as many seconds while it lasts; None or 0: never).
        self._stall = stall or None
        self._quiet_since = time.monotonic()
        self._stall_said: Optional[float] = None  # when the view was last told
        self._interrupts = interrupts.Interrupts(None)  # held while the run goes on
        self._pipes: Optional[RunPipes] = None  # made by run
        self._driver: Optional[_Driver] = None  # made by run

    # -- the run --------------------------------------------------------------------------

    def run(self) -> RunOutcome:
        self._started = time.monotonic()
        if self.options.began is None:
            self.outcome.began = self._started
        opts = self.options
        self._shm_dir = None if opts.hosted else shared_tensors.make_dir(self.run_id)
        # The run's pipes go where its rings do: in tmpfs, making one costs less than in a
        # disk's /tmp (2 a replica process, and 2 more, every run; bench/launch_overhead.py
        # measures both). A session's cells read the session's own.
        self._pipes = pipes = self._replicas.pipes(self._shm_dir or self.run_dir,
                                                   self.plan.processes)
        pipes.begin(self._handle, self._c_output)
        # A Manager lock costs connections to the manager every run: only cells that use
        # it pay.
        lock = shared_lock.new_lock() if "lock" in self.cell.source else None
        self._replicas.begin()  # after the manager exists: every new child is the run's
        forked, running = self._replicas.inherit, self._replicas.running
        # Processes that run already (a session's) have their start-up behind them, and
        # the environment they were started with: a cell's changes to os.environ stay, as
        # in a notebook.
        job = ReplicaJob(
            run_id=self.run_id, run_dir=self.run_dir, channel_path=pipes.channel_path,
            parent_pid=opts.parent_pid, lock=lock, fd_paths=tuple(pipes.fd_paths),
            startup_path=None if running else pipes.startup_path,
            environ=None if running else replica_environ(self.plan.env),
            cell=None if forked else self.cell, names=None if forked else opts.names,
            cache_dir=opts.cache_dir, pull=opts.pull, pull_from=opts.pull_from,
            shm_dir=self._shm_dir, ring_dir=pipes.directory, chosen=opts.chosen)
        driver = self._driver = _Driver(lambda: self._drive(job, pipes.write_fd), pipes.done_w,
                                        threaded=self._replicas.threaded)
        # From here on an Interrupt is a flag the read loop checks (see
        # colab_xla.notebook.interrupts): a second one during the clean-up cannot break it
        # either.
        replaced = opts.launch.runtime.replaces
        inherited = (inherit(self.run_id, self.user_ns, self.cell, replaced) if forked
                     else contextlib.nullcontext())
        with inherited, interrupts.held(opts.hosted) as self._interrupts:
            try:
                self.observer.opened(self.outcome)
                driver.start()
                try:
                    self._read_until_done()
                except KeyboardInterrupt:  # raised by a view's own code: an Interrupt too
                    self._interrupts.requested = True
                if self._interrupts.requested:
                    self.outcome.interrupted = True
                    self._cut("interrupted")
                if self._deadlines.stop:
                    self._replicas.stop(driver, lambda until: self._read_until_done(
                        until=until), self._deadlines.stop)
                else:
                    driver.join()
                self._drain()
                # A refusal before any process, or a session's cell that could not be sent:
                # no replica ran it, none to settle (its processes did not die).
                unsent = (self._driver_error is not None and not self.outcome.replicas
                          and (isinstance(self._driver_error, SetupError)
                               or self._replicas.running))
                if not unsent:
                    self._settle_unreported()
                if (self._driver_error is not None and not self.outcome.replicas
                        and not self._deadlines.stop):
                    # The launcher failed before any replica said a word (xmp.spawn, or
                    # the runtime's set-up of the run's processes): the run never started.
                    self.outcome.launch_error = endings.launch_error(
                        self._driver_error, session=self._replicas.running)
                # Replicas arrive in any order; the outcome a person reads is by ordinal.
                self.outcome.replicas = dict(sorted(self.outcome.replicas.items()))
            finally:
                # Nothing of the run outlives it, whatever happened: after an error above,
                # the driver may still be starting replica processes.
                self._replicas.release(driver)
                driver.close()  # (before the pipes go back: done_w is closed with them)
                self._driver = None
                if self._shm_dir is not None:  # tensors already mapped stay valid
                    shared_tensors.remove_dir(self._shm_dir)
                self._replicas.done_with(pipes)
                self.outcome.elapsed = time.monotonic() - self.outcome.began
                self._finish_logs()
                # Its traceback's frames hold the pool (each process's sentinel pipe) and this
                # run: a cycle that kept those fds open until a garbage collection.
                self._driver_error = None
        return self.outcome

    def _drive(self, job: ReplicaJob, write_fd: int) -> None:
        writer = frames.ChannelWriter(write_fd)

        def ended(ordinal: int, code: int) -> None:  # told after its own frames
            writer.send(frames.NOTE, ordinal, json.dumps({"ended": code}).encode())

        try:
            self._replicas.drive(job, ended, self._driver.over)
        except BaseException as exc:  # noqa: BLE001 - reported through the outcome
            self._driver_error = exc  # (let go of when the run ends: see run)
            self._driver.over()

    def _read_until_done(self, until: Optional[float] = None) -> None:
        """Read until the driver is done, the run is cut, or (once it was cut, while the
        replicas are being stopped) the time ``until``: what the pipes and rings bring
        (:class:`RunPipes`), interleaved with the deadlines (:class:`Deadlines`), the held
        pieces of C-level lines (:class:`PartialLines`), the views' draws
        (:class:`DrawPacer`) and, once a tick, the look for the replicas' processes."""
        pipes, held, cut = self._pipes, self._held, self._deadlines
        done_r = pipes.done_r
        fds = [pipes.read_fd, done_r, *pipes.fd_sources]
        if self._interrupts.wake_fd is not None and until is None:
            fds.append(self._interrupts.wake_fd)
        draws = DrawPacer(time.monotonic())
        next_track = draws.due  # when the replicas' processes are looked for again
        while True:
            now = time.monotonic()
            if until is not None:
                if now >= until:
                    return
                times = (draws.due, until)
            else:
                if self._interrupts.requested:
                    return
                reason = cut.passed(now)
                if reason:
                    self._cut(reason)
                    return
                times = (draws.due, cut.timeout_at, cut.fail_at, cut.start_at)
            wake = pipes.look(now, min(t for t in times if t is not None))
            if held.pieces:
                wake = min(wake, held.due())
            readable, _, _ = select.select(fds, [], [], max(0.0, wake - now))
            for fd in readable:
                if fd not in (done_r, self._interrupts.wake_fd):
                    pipes.read_one(fd)
            if held.pieces:
                for piece in held.release(time.monotonic()):
                    self._emit(piece.origin, piece.kind, piece.text)
            if self._output_since_draw:
                draws.output(time.monotonic())
            if time.monotonic() >= draws.due:
                self.observer.tick(self.outcome)  # (drawn first: what a person waits for)
                now, self._output_since_draw = time.monotonic(), False
                draws.drew(now)
                if now >= next_track:  # a pass over /proc: once a tick, not per draw
                    self._replicas.tick()
                    next_track = now + draw_pacing.TICK_SECONDS
                    if until is None and self._stalled(now):
                        self._say_where(now)
            if readable == [done_r]:
                return  # the driver ended and the pipes hold nothing more right now

    def _cut(self, reason: str) -> None:
        """Stop the run now: what the pipes hold was written before this moment and counts
        (a replica that reported its end in time is done: for a timeout, one that ended
        before the deadline, see :meth:`Deadlines.in_time`); a report read after it is late
        and ignored, so the replica is settled as stopped for ``reason``, even if the kill
        comes too late to stop it (a --timeout shorter than the start-up)."""
        self._pipes.read_held()
        self._deadlines.stop = reason
        # Where they were, before they are stopped: taken by a thread of each replica's
        # process (colab_xla.wire.stacks), in a moment unless its native code holds Python;
        # replicas that answer before they take the stop are read once stopped.
        asked = self._ask_where()
        if self._replicas.answer_first:
            self._asked_where = asked
        else:
            self._places = self._where(asked)

    def _ask_where(self) -> Optional[Tuple[Dict[int, Tuple[int, int]], stacks.Asked]]:
        """Ask each replica still running for its stack (also one blocked in native code:
        colab_xla.wire.stacks); :meth:`_where` says where they were."""
        running = {o: t for o, t in self._threads.items()
                   if self.outcome.replica(o).state not in (DONE, FAILED)}
        if not running:
            return None
        return ({o: (pid, ident) for o, (pid, ident, _) in running.items()},
                stacks.ask({pid: path for pid, _, path in running.values()}))

    def _where(self, asked) -> Dict[int, str]:
        """Where in the cell each replica :meth:`_ask_where` asked was (within about a
        second of asking)."""
        if asked is None:
            return {}
        threads, request = asked
        return stacks.places(stacks.collect(request), request, threads, self.cell.path,
                             self.cell.lines)

    def _c_output(self, fd: int, rank: int, kind: int, data: bytes) -> None:
        """C-level output read from pipe ``fd`` of process ``rank``: its ended lines now, the
        rest held (see colab_xla.notebook.partial_lines). It belongs to the process's
        replica if the process runs only that one."""
        if rank == STARTUP:
            origin = STARTUP_LABEL
        else:  # (decided here, not in a method of its own: this runs for every read)
            ordinals = self._ranks.get(rank, ())
            per_process = (self.plan.replicas or 0) // max(1, self.plan.processes)
            origin = (next(iter(ordinals)) if len(ordinals) == 1 and per_process == 1
                      else f"process {rank}")
        self._emit(origin, kind, self._held.ended(fd, origin, kind,
                                                  self._decoded(origin, kind, data)))

    def _drain(self) -> None:
        # Every replica process has exited: what they wrote is in the pipes already.
        self._pipes.read_all_after_exit()
        for piece in self._held.release():
            self._emit(piece.origin, piece.kind, piece.text)
        for (origin, kind), dec in self._decoders.items():
            self._emit(origin, kind, dec.decode(b"", final=True))

    # -- frames -----------------------------------------------------------------------------

    def _handle(self, frame: frames.Frame) -> None:
        if frame.kind in frames.STREAMS:
            self._text(self._origin(frame), frame.kind, frame.payload)
        elif frame.kind == frames.START:
            info = json.loads(frame.payload)
            rep = self.outcome.replica(frame.ordinal)
            rep.pid = frame.pid
            self._pid_rank[frame.pid] = info["rank"]
            if info.get("stacks"):
                self._threads[frame.ordinal] = (frame.pid, info["thread"], info["stacks"])
            self._ranks.setdefault(info["rank"], set()).add(frame.ordinal)
            self._replicas.started(frame.pid)
            self._deadlines.started(frame.ordinal)
            self.observer.started(self.outcome, frame.ordinal)
        elif frame.kind == frames.END:
            self._replicas.finished(frame.ordinal)
            if not self._deadlines.in_time(frame.payload):
                return  # sent after the run was cut (see _cut) or after --timeout's deadline
            self._load_report(frame.ordinal, values.sent_report(frame.payload))
            if self.outcome.replicas[frame.ordinal].error:
                self._deadlines.failed(frame.ordinal, time.monotonic())
            self.observer.finished(self.outcome, frame.ordinal)
        elif frame.kind == frames.DISPLAY:
            shown = displays.load(self.run_dir, frame.payload.decode("utf-8", "replace"))
            self._emit_display(self._origin(frame), shown)
        elif frame.kind == frames.NOTE:
            note = json.loads(frame.payload)
            if "rendezvous" in note:
                self.outcome.replica(frame.ordinal).last_rendezvous = note["rendezvous"]
            if "exit" in note:  # os._exit: the process ends now, with its replicas
                self._exits[note["pid"]] = (frame.ordinal, note["exit"])
            if "ended" in note:  # the process of this replica alone ended (see _drive)
                self._process_ended(frame.ordinal, note["ended"])
            if "progress" in note and frame.ordinal >= 0:  # a tqdm bar (replica/progress.py)
                self._progress(frame.ordinal, note["progress"])

    def _origin(self, frame: frames.Frame):
        """Whose output ``frame`` is: its replica's ordinal, or for a thread of a process
        that is not a replica, the process (``"process 0"``)."""
        if frame.ordinal >= 0:
            return frame.ordinal
        return f"process {self._pid_rank.get(frame.pid, '?')}"

    def _process_ended(self, ordinal: int, code: int) -> None:
        """A replica's own process ended with ``code``. Before its report, the replica
        died: the others get :data:`.deadlines.FAIL_FAST_SECONDS`, as after a failure (they may wait
        for it in a collective). Processes the run kills after it was cut do not count."""
        rep = self.outcome.replica(ordinal)
        if self._deadlines.stop or rep.state in (DONE, FAILED):
            return
        self._died[ordinal] = code
        self._deadlines.failed(ordinal, time.monotonic())

    def _text(self, origin, kind: int, data: bytes) -> None:
        self._emit(origin, kind, self._decoded(origin, kind, data))

    def _decoded(self, origin, kind: int, data: bytes) -> str:
        key = (origin, kind)
        dec = self._decoders.get(key)
        if dec is None:
            dec = self._decoders[key] = codecs.getincrementaldecoder("utf-8")("replace")
        return dec.decode(data)

    def _log(self, origin):
        return (self.outcome.replica(origin).log if isinstance(origin, int)
                else self.outcome.process(origin))

    def _stalled(self, now: float) -> bool:
        """Whether the replicas have been quiet for --stall seconds, and the view was not
        told so within as many seconds."""
        return (self._stall is not None and now - self._quiet_since >= self._stall
                and (self._stall_said is None or now - self._stall_said >= self._stall))

    def _say_where(self, now: float) -> None:
        """Tell the view where each replica still running is (a stall: the run goes on)."""
        places = self._where(self._ask_where())
        if not places:
            return
        self._stall_said = time.monotonic()
        self.observer.stalled(self.outcome, Stall(now - self._quiet_since, places))

    def _emit(self, origin, kind: int, text: str) -> None:
        if text:
            self._heard()
            lines = self._log(origin).write(frames.STREAMS[kind], text)
            self.observer.output(self.outcome, origin, lines)

    def _emit_display(self, origin, shown) -> None:
        """A displayed object of ``origin``'s, as a line of its output (the views draw it)."""
        self._heard()
        self.observer.output(self.outcome, origin, [self._log(origin).display(shown)])

    def _progress(self, ordinal: int, bar: dict) -> None:
        """A tqdm bar of replica ``ordinal`` moved (the views draw it), or closed: a bar to
        be left stays drawn as it ended, and its last line joins the replica's output; any
        other goes."""
        self._heard()
        rep = self.outcome.replica(ordinal)
        rep.progress_changes += 1
        if bar.get("closed") and not bar.get("leave"):
            rep.progress.pop(bar["bar"], None)
            return
        rep.progress[bar["bar"]] = bar
        if bar.get("closed"):
            self.observer.output(self.outcome, ordinal, [rep.log.bar_ended(bar["text"])])

    def _heard(self) -> None:
        """Output came: the replicas are not quiet (a stall notice goes)."""
        self._quiet_since = time.monotonic()
        if self._stall_said is not None:
            self._stall_said = None
            self.observer.stalled(self.outcome, None)
        self._output_since_draw = True

    def _finish_logs(self) -> None:
        for rep in self.outcome.replicas.values():  # bars a stop left open: their last line
            for bar in list(rep.progress.values()):
                if not bar.get("closed"):
                    self._progress(rep.ordinal, dict(bar, closed=True, leave=True))
        for origin in [*self.outcome.replicas, *self.outcome.processes]:
            lines = self._log(origin).finish()
            if lines:
                self.observer.output(self.outcome, origin, lines)

    def _load_report(self, ordinal: int, sent: bytes) -> None:
        rep = self.outcome.replica(ordinal)
        report = values.read_report(self.run_dir, ordinal, sent)
        # Wall time as the person waiting sees it: from the run's start (fork, runtime
        # start-up included) to this replica's report.
        rep.elapsed = time.monotonic() - self._started
        rep.error, rep.value_repr = report.error, report.value_repr
        if self.options.hosted:  # loaded in the notebook (see RunRequest.hosted)
            rep.value, rep.has_value = report.value, report.value is not None
            rep.pulled = dict(report.pulled)
        else:
            load_results(rep, report.value, report.pulled, self.user_ns)
        rep.state = FAILED if rep.error else DONE

    def _expected(self) -> Sequence[int]:
        """The replicas that run the cell, as far as is known before they start."""
        if self.options.chosen is not None:
            return self.options.chosen
        return range(self.plan.replicas) if self.plan.replicas else ()

    def _settle_unreported(self) -> None:
        """Replicas that never sent a report: stopped with the run, or their process died."""
        if self._asked_where is not None:
            self._places = self._where(self._asked_where)
        ordinals = sorted(set(self._expected()) | set(self.outcome.replicas))
        # Those whose process died first: a replica stopped after it names its error.
        for ordinal in sorted(ordinals, key=lambda o: o not in self._died):
            rep = self.outcome.replica(ordinal)
            if rep.state in (DONE, FAILED):
                continue
            if ordinal in self._died:
                rep.state, rep.elapsed = FAILED, time.monotonic() - self._started
                rep.error = endings.died(
                    rep, exits=self._exits, exit_codes=[self._died[ordinal]],
                    process_logs=self.outcome.processes.values(), one_process=True,
                    memory=self._replicas.memory_note(rep.pid))
            elif self._deadlines.stop:
                rep.state, rep.elapsed = STOPPED, time.monotonic() - self._started
                rep.error = dataclasses.replace(self._deadlines.stopped(
                    rep, self.outcome.replicas), place=self._places.get(ordinal, ""))
            else:
                rep.state = FAILED
                rep.error = endings.died(
                    rep, exits=self._exits, exit_codes=self._replicas.exit_codes(),
                    process_logs=self.outcome.processes.values(),
                    one_process=self.plan.processes == 1, driver_error=self._driver_error,
                    memory=self._replicas.memory_note(rep.pid))
