"""The run loop, on the notebook's side: one :class:`Supervisor` per run.

It makes the run's pipes (one for frames, a pair per replica process for C-level output,
one for what processes print before their rank is known), starts the replicas through
:mod:`colab_xla.notebook.launch` in a driver thread, and reads every pipe in the calling thread
(the kernel's main thread, so it stays interruptible) until the replicas have ended: frames
become the outcome's output lines, starts, reports and notes, and the observer (a view)
hears of each. It cuts the run on Interrupt, ``--timeout`` or :data:`FAIL_FAST_SECONDS`
after a replica failed, settles every replica that sent no report
(:mod:`colab_xla.notebook.endings`), and kills every process of the run
(:class:`colab_xla.notebook.processes.RunProcesses`) whatever happened.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import itertools
import json
import os
import secrets
import select
import threading
import time
from typing import Any, Dict, Optional, Tuple

from . import draw_pacing, endings, hardware, interrupts, shared_lock, state
from ..wire.cell import CellModule
from .deadlines import FAIL_FAST_SECONDS, Deadlines
from .draw_pacing import NEXT_DRAW_SECONDS, TICK_SECONDS, DrawPacer
from .launch import Launch, inherit, replica_environ
from .outcome import DONE, FAILED, STOPPED, RunObserver, RunOutcome, load_results
from .partial_lines import PartialLines
from .replicas import FreshReplicas, Replicas
from ..wire.job import ReplicaJob
from ..wire import frames, ring, shared_tensors, values

# Imported from here by other modules (the names they had before this module was split).
__all__ = ["RunRequest", "Supervisor", "Replicas", "FreshReplicas", "DrawPacer",
           "TICK_SECONDS", "NEXT_DRAW_SECONDS", "FAIL_FAST_SECONDS"]

# While replica processes write to output rings, the reader looks at them at least this
# often: a ring's wake-up can be lost (a writer and the reader each store, then load what
# the other stored: x86 may order those loads first), and a lost one must cost a few
# milliseconds, not a tick.
RING_POLL_SECONDS = 0.005
# While output flows (the last look found some), the reader looks again this long after,
# without asking for a wake-up: a writer then pays no system call per line (a wake-up
# cost a fast replica one in three lines), and the reader takes more lines per look. A
# replica's end wakes it anyway: a warm session's cell waits for nothing else.
RING_FLOW_SECONDS = 0.002
READ_SIZE = 1 << 16  # what one read of a pipe takes
PIPE_READS = frames.PIPE_SIZE // READ_SIZE  # reads that take what a full pipe holds


# The origin of output of replica processes before their replicas start (see Supervisor.run).
STARTUP, STARTUP_LABEL = -1, "process start-up"


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """What a run does besides running the cell (see :func:`colab_xla.notebook.run.run_cell`)."""

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


class Supervisor:
    """One run, from the notebook's side: start the replicas in a driver thread, read what
    they send until they end (or the run is cut), settle every replica in the outcome, and
    leave nothing running. Call :meth:`run` once."""

    def __init__(self, options: RunRequest, plan: hardware.ReplicaPlan, run_dir: str,
                 user_ns: Dict[str, Any], observer: RunObserver, timeout: Optional[float],
                 replicas: Optional[Replicas] = None):
        self.options, self.cell = options, options.cell
        self.plan, self.run_dir, self.observer = plan, run_dir, observer
        self.timeout = timeout
        self._deadlines = Deadlines(timeout, time.monotonic())  # and why the run was cut
        self.user_ns = user_ns
        self.run_id = secrets.token_hex(8)
        self.outcome = RunOutcome(device_type=plan.device_type, log_dir=state.new_log_dir())
        self._decoders: Dict[tuple, Any] = {}
        self._held = PartialLines()  # unended C-level lines, by the pipe they came from
        self._ranks: Dict[int, set] = {}  # local process rank -> ordinals it runs
        self._pid_rank: Dict[int, int] = {}
        self._replicas = replicas or FreshReplicas(self.run_id, options.launch, plan)
        self._driver_error: Optional[BaseException] = None
        self._output_since_draw = False
        self._exits: Dict[int, Tuple[int, int]] = {}  # pid -> (replica, code) of os._exit
        self._died: Dict[int, int] = {}  # replica -> exit code of its own process
        self._interrupts = interrupts.Interrupts(None)  # held while the run goes on
        self._decoder = frames.FrameDecoder()  # (an Interrupt may come before reading starts)
        # The replica processes' output rings, by path (see colab_xla.wire.ring).
        self._rings: Dict[str, Tuple[ring.RingReader, frames.FrameDecoder]] = {}
        self._ring_output = False  # a ring had output since the reading loop last looked

    # -- the run --------------------------------------------------------------------------

    def run(self) -> RunOutcome:
        self._started = time.monotonic()
        opts = self.options
        self._shm_dir = None if opts.hosted else shared_tensors.make_dir(self.run_id)
        # The run's pipes go where its rings do: in tmpfs, making one costs less than in a
        # disk's /tmp (2 a replica process, and 2 more, every run; bench/launch_overhead.py
        # measures both).
        pipe_dir = self._shm_dir or self.run_dir
        channel_path = os.path.join(pipe_dir, "channel")
        read_fd, write_fd = frames.make_fifo(channel_path)
        done_r, done_w = os.pipe()
        fd_paths = [tuple(os.path.join(pipe_dir, f"process-{rank}.{kind}")
                          for kind in ("stdout", "stderr"))
                    for rank in range(self.plan.processes)]
        fd_pipes = [tuple(frames.make_fifo(path) for path in pair) for pair in fd_paths]
        self._fd_sources = {pipe[0]: (rank, kind)
                            for rank, pair in enumerate(fd_pipes)
                            for kind, pipe in zip((frames.STDOUT, frames.STDERR), pair)}
        # What a replica process prints before its rank is known (torch_xla starting its
        # runtime: XLA's fatal message for a bad XLA_FLAGS, say) goes to one more pipe.
        startup_path = os.path.join(pipe_dir, "startup")
        startup = frames.make_fifo(startup_path)
        self._fd_sources[startup[0]] = (STARTUP, frames.STDERR)
        fd_pipes.append((startup,))
        # A Manager lock costs ~5 ms of connections per run: only cells that use it pay.
        lock = shared_lock.new_lock() if "lock" in self.cell.source else None
        self._replicas.begin()  # after the manager exists: every new child is the run's
        forked = self._replicas.inherit
        job = ReplicaJob(
            run_id=self.run_id, run_dir=self.run_dir, channel_path=channel_path,
            parent_pid=opts.parent_pid, lock=lock, fd_paths=tuple(fd_paths),
            startup_path=startup_path,
            environ=replica_environ(self.plan.env),
            cell=None if forked else self.cell, names=None if forked else opts.names,
            cache_dir=opts.cache_dir, pull=opts.pull, pull_from=opts.pull_from,
            shm_dir=self._shm_dir, rings=True)
        driver = threading.Thread(target=self._drive, args=(job, done_w, write_fd),
                                  name="colab_xla-driver", daemon=True)
        # From here on an Interrupt is a flag the read loop checks (see colab_xla.notebook.interrupts):
        # a second one during the clean-up cannot break it either.
        inherited = (inherit(self.run_id, self.user_ns, self.cell) if forked
                     else contextlib.nullcontext())
        with inherited, interrupts.held(opts.hosted) as self._interrupts:
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
                if self._deadlines.stop:
                    self._replicas.stop(driver, lambda until: self._read_until_done(
                        read_fd, done_r, until=until))
                else:
                    driver.join()
                self._drain(read_fd)
                self._settle_unreported()
                if (self._driver_error is not None and not self.outcome.replicas
                        and not self._deadlines.stop):
                    self.outcome.launch_error = endings.launch_error(self._driver_error)
                # Replicas arrive in any order; the outcome a person reads is by ordinal.
                self.outcome.replicas = dict(sorted(self.outcome.replicas.items()))
            finally:
                # Nothing of the run outlives it, whatever happened: after an error above,
                # the driver may still be starting replica processes.
                self._replicas.release(driver)
                if self._shm_dir is not None:  # tensors already mapped stay valid
                    shared_tensors.remove_dir(self._shm_dir)
                for reader, _ in self._rings.values():
                    reader.close()
                for fd in (read_fd, write_fd, done_r, done_w,
                           *(fd for pair in fd_pipes for pipe in pair for fd in pipe)):
                    os.close(fd)
                self.outcome.elapsed = time.monotonic() - self._started
                self._finish_logs()
                # Its traceback's frames hold the pool (each process's sentinel pipe) and this
                # run: a cycle that kept those fds open until a garbage collection.
                self._driver_error = None
        return self.outcome

    def _drive(self, job: ReplicaJob, done_w: int, write_fd: int) -> None:
        writer = frames.ChannelWriter(write_fd)

        def ended(ordinal: int, code: int) -> None:  # told after its own frames
            writer.send(frames.NOTE, ordinal, json.dumps({"ended": code}).encode())

        try:
            self._replicas.drive(job, ended)
        except BaseException as exc:  # noqa: BLE001 - reported through the outcome
            self._driver_error = exc  # (let go of when the run ends: see run)
        finally:
            os.write(done_w, b"x")

    def _read_until_done(self, read_fd: int, done_r: int, until: Optional[float] = None) -> None:
        """Read until the driver is done, the run is cut, or (once it was cut, while the
        replicas are being stopped) the time ``until``."""
        fds = [read_fd, done_r, *self._fd_sources]
        if self._interrupts.wake_fd is not None and until is None:
            fds.append(self._interrupts.wake_fd)
        held, cut = self._held, self._deadlines
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
                    self._cut(reason, read_fd)
                    return
                times = (draws.due, cut.timeout_at, cut.fail_at)
            wake = min(t for t in times if t is not None)
            self._read_rings()
            if not self._ring_output:  # none since the last look (here, or by _read): ask
                for reader, _ in self._rings.values():
                    reader.waiting(True)  # (then read: what came before the flag is not missed)
                if self._read_rings():
                    for reader, _ in self._rings.values():
                        reader.waiting(False)
            flowing, self._ring_output = self._ring_output, False
            if self._rings:
                wake = min(wake, now + (RING_FLOW_SECONDS if flowing else RING_POLL_SECONDS))
            if held.pieces:
                wake = min(wake, held.due())
            readable, _, _ = select.select(fds, [], [], max(0.0, wake - now))
            for fd in readable:
                if fd not in (done_r, self._interrupts.wake_fd):
                    self._read(fd, read_fd)
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
            if readable == [done_r]:
                return  # the driver ended and the pipes hold nothing more right now

    def _cut(self, reason: str, read_fd: int) -> None:
        """Stop the run now: what the pipes hold was written before this moment and counts
        (a replica that reported its end in time is done: for a timeout, one that ended
        before the deadline, see :meth:`Deadlines.in_time`); a report read after it is late
        and ignored, so the replica is settled as stopped for ``reason``, even if the kill
        comes too late to stop it (a --timeout shorter than the start-up)."""
        for fd in [read_fd, *self._fd_sources]:
            self._read_ready(fd, read_fd, PIPE_READS)
        self._read_rings()
        self._deadlines.stop = reason

    def _read(self, fd: int, read_fd: int) -> bool:
        """Read what ``fd`` has; False at end of file."""
        data = os.read(fd, READ_SIZE)
        if fd == read_fd:
            for frame in self._decoder.feed(data, merge=True):
                if frame.kind == ring.RING:
                    self._open_ring(frame.payload.decode())
                elif frame.kind == ring.WAKE:
                    pass  # the rings are read below
                else:
                    if frame.kind not in frames.STREAMS:
                        # Sent after what the rings hold (the driver's note that a process
                        # ended, say): handled after it.
                        self._read_rings()
                    self._handle(frame)
            self._read_rings()
        elif data:
            rank, kind = self._fd_sources[fd]
            self._catch_up(read_fd)
            self._c_output(fd, rank, kind, data)
        return bool(data)

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

    def _catch_up(self, read_fd: int) -> None:
        """Handle the frames sent before C-level output was read: the process's start,
        which says whose output it is, and the Python lines printed before it. (While
        output flows, a ring's frames come without a wake-up, so a C-level line can wake
        the loop before them.)"""
        self._read_ready(read_fd, read_fd, PIPE_READS)
        self._read_rings()

    def _read_ready(self, fd: int, read_fd: int, reads: Optional[int] = None) -> None:
        """Read what ``fd`` holds, without waiting for more: at most ``reads`` reads (what
        the pipe held when asked, while writers may go on), else until it is empty."""
        for _ in range(reads) if reads is not None else itertools.count():
            if not (select.select([fd], [], [], 0)[0] and self._read(fd, read_fd)):
                return

    def _drain(self, read_fd: int) -> None:
        # Every replica process has exited: what they wrote is in the pipes already.
        for fd in [read_fd, *self._fd_sources]:
            self._read_ready(fd, read_fd)
        self._read_rings()  # (those of processes that were killed too)
        for piece in self._held.release():
            self._emit(piece.origin, piece.kind, piece.text)
        for (origin, kind), dec in self._decoders.items():
            self._emit(origin, kind, dec.decode(b"", final=True))

    def _open_ring(self, path: str) -> None:
        if path not in self._rings and os.path.dirname(path) in (self.run_dir, self._shm_dir):
            self._rings[path] = (ring.RingReader(path), frames.FrameDecoder())

    def _read_rings(self) -> bool:
        """Handle what the replica processes' rings hold; whether there was anything."""
        got = False
        for reader, decoder in self._rings.values():
            data = reader.read()
            if data:
                got = self._ring_output = True
                # (decoded with merge: a replica's consecutive lines come as one frame)
                for frame in decoder.feed(data, merge=True):
                    self._handle(frame)
        return got

    # -- frames -----------------------------------------------------------------------------

    def _handle(self, frame: frames.Frame) -> None:
        if frame.kind in frames.STREAMS:
            origin = frame.ordinal
            if origin < 0:  # a thread of the process that is not a replica
                origin = f"process {self._pid_rank.get(frame.pid, '?')}"
            self._text(origin, frame.kind, frame.payload)
        elif frame.kind == frames.START:
            info = json.loads(frame.payload)
            rep = self.outcome.replica(frame.ordinal)
            rep.pid = frame.pid
            self._pid_rank[frame.pid] = info["rank"]
            self._ranks.setdefault(info["rank"], set()).add(frame.ordinal)
            self._replicas.started(frame.pid)
            self.observer.started(self.outcome, frame.ordinal)
        elif frame.kind == frames.END:
            self._replicas.finished(frame.ordinal)
            if not self._deadlines.in_time(frame.payload):
                return  # sent after the run was cut (see _cut) or after --timeout's deadline
            self._load_report(frame.ordinal)
            if self.outcome.replicas[frame.ordinal].error:
                self._deadlines.failed(frame.ordinal, time.monotonic())
            self.observer.finished(self.outcome, frame.ordinal)
        elif frame.kind == frames.NOTE:
            note = json.loads(frame.payload)
            if "rendezvous" in note:
                self.outcome.replica(frame.ordinal).last_rendezvous = note["rendezvous"]
            if "exit" in note:  # os._exit: the process ends now, with its replicas
                self._exits[note["pid"]] = (frame.ordinal, note["exit"])
            if "ended" in note:  # the process of this replica alone ended (see _drive)
                self._process_ended(frame.ordinal, note["ended"])

    def _process_ended(self, ordinal: int, code: int) -> None:
        """A replica's own process ended with ``code``. Before its report, the replica
        died: the others get :data:`FAIL_FAST_SECONDS`, as after a failure (they may wait
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

    def _emit(self, origin, kind: int, text: str) -> None:
        if text:
            self._output_since_draw = True
            lines = self._log(origin).write(frames.STREAMS[kind], text)
            self.observer.output(self.outcome, origin, lines)

    def _finish_logs(self) -> None:
        for origin in [*self.outcome.replicas, *self.outcome.processes]:
            lines = self._log(origin).finish()
            if lines:
                self.observer.output(self.outcome, origin, lines)

    def _load_report(self, ordinal: int) -> None:
        rep = self.outcome.replica(ordinal)
        report = values.read_report(self.run_dir, ordinal)
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

    def _settle_unreported(self) -> None:
        """Replicas that never sent a report: stopped with the run, or their process died."""
        expected = range(self.plan.replicas) if self.plan.replicas else ()
        ordinals = sorted(set(expected) | set(self.outcome.replicas))
        # Those whose process died first: a replica stopped after it names its error.
        for ordinal in sorted(ordinals, key=lambda o: o not in self._died):
            rep = self.outcome.replica(ordinal)
            if rep.state in (DONE, FAILED):
                continue
            if ordinal in self._died:
                rep.state, rep.elapsed = FAILED, time.monotonic() - self._started
                rep.error = endings.died(
                    rep, exits=self._exits, exit_codes=[self._died[ordinal]],
                    process_logs=self.outcome.processes.values(), one_process=True)
            elif self._deadlines.stop:
                rep.state, rep.elapsed = STOPPED, time.monotonic() - self._started
                rep.error = self._deadlines.stopped(rep, self.outcome.replicas)
            else:
                rep.state = FAILED
                rep.error = endings.died(
                    rep, exits=self._exits, exit_codes=self._replicas.exit_codes(),
                    process_logs=self.outcome.processes.values(),
                    one_process=self.plan.processes == 1, driver_error=self._driver_error)
