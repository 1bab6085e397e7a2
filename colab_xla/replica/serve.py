"""A replica of a session (``%xla_session``): started once, it runs every cell the
notebook sends, in globals it keeps from cell to cell.

:func:`serve` is what the launcher calls in each replica instead of
:func:`colab_xla.replica.execution.main`. The replica's process is set up once (its streams,
torch_xla instrumented, the CPU simulation's collectives); each cell is then a run like a
one-off run's (its report and frames: :func:`colab_xla.replica.execution.serve_run`), with
two differences: the cell's globals are the replica's own from the cells before, with the
notebook names the cell brings on top; and the pipes and output ring it writes to are the
session's, made as it starts and opened once (:meth:`ReplicaProcess.open_pipes
<colab_xla.replica.process.ReplicaProcess.open_pipes>`): between cells the session reads
them (:mod:`colab_xla.notebook.targets.session_output`).

The notebook speaks to each replica through two named pipes of the session's directory,
one line per command. The replica's own thread reads the command pipe as it waits for the
next cell: ``job BASE64`` or ``run PATH`` (a cell's
:class:`~colab_xla.wire.job.ReplicaJob`, pickled in the line, or pickled in a
file: :func:`colab_xla.wire.job.job_to_command`), ``debug IN OUT`` (a post-mortem debugger on the
last cell's exception, its prompt and answers through the named pipes OUT and IN:
:func:`debug`, for ``%xla_debug``) and ``stop``. A thread of the replica reads the urgent
pipe all the time: ``interrupt RUN_ID`` and ``complete PATH EXPR`` (Tab completion). An
interrupt raises KeyboardInterrupt in the replica's cell, as IPython does in a notebook:
through SIGINT when the replica runs in its process's main thread (even ``time.sleep``
stops), else as an asynchronous exception of its thread, which takes effect at the
cell's next Python line (native code and collectives finish first). A SIGINT the notebook
did not send through the urgent pipe is not an interrupt: Jupyter's Interrupt signals the
kernel's whole process group, replicas included, and the notebook interrupts them itself,
after it asked where they are.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import select
import signal
import threading
import traceback
from typing import Deque, Dict, NamedTuple, Optional, Union

from ..runtimes.thread import current
from ..wire import completions, pdb_pipes, shared_tensors, stacks
from ..wire.frames import NOTE
from ..wire.names import REPLICA_NAMES
from .execution import ReplicaGlobals, cell_globals, serve_run
from ..wire.job import (JOB_VERBS, ReplicaJob, job_from_command, command_path, failure_path,
                        urgent_path)
from .process import ReplicaProcess


# The exit code of a session replica that failed outside its cell (EX_SOFTWARE).
FAILED_EXIT_CODE = 70


def serve(index: int, job: ReplicaJob) -> None:
    """Be replica ``index`` of the session ``job`` describes until the notebook says stop
    (or goes away)."""
    try:
        _serve(index, job)
    except BaseException:  # noqa: BLE001 - a bug here: the session must see this replica die
        text = "colab_xla: a session replica failed outside its cell:\n" + traceback.format_exc()
        # To its file first (the notebook reads it when the process has ended), then to
        # stderr: the session's pipe, closed if the session is ending, and a write there
        # that raised again would end the process with exit code 1, saying nothing.
        with contextlib.suppress(OSError), open(failure_path(job.run_dir, index), "w") as f:
            f.write(text)
        with contextlib.suppress(OSError):
            os.write(2, text.encode("utf-8", "replace"))
        os._exit(FAILED_EXIT_CODE)


def _serve(index: int, job: ReplicaJob) -> None:
    process = ReplicaProcess.get(job)
    interruptible = Interruptible()
    current.interruptible = interruptible
    commands = _Commands(command_path(job.run_dir, index),
                         urgent_path(job.run_dir, index), interruptible)
    shared_tensors.keep_mappings()  # its large results' pages, written again, cost a copy
    process.writer.send(NOTE, index, json.dumps({"ready": os.getpid(),
                                                 "rank": process.rank}).encode())
    kept: Optional[ReplicaGlobals] = None

    def session_globals(index, cell_job, process):
        nonlocal kept
        if kept is None:  # the first cell: the notebook's names the replica started with
            kept = ReplicaGlobals({k: v for k, v in process.user_ns.items()
                                   if k not in REPLICA_NAMES})
        kept.update((k, v) for k, v in process.received.items() if k not in REPLICA_NAMES)
        commands.namespace = kept  # (what the notebook's Tab completes from)
        return cell_globals(kept, index, cell_job, process)

    while True:
        cell_job = commands.next()
        if cell_job is None:
            return
        if isinstance(cell_job, DebugRequest):  # between cells, in the replica's thread
            debug(cell_job, current.failure)
            continue
        try:
            serve_run(index, cell_job, session_globals, end_started=False)
        except KeyboardInterrupt:  # an interrupt that came as the cell ended: it is over
            pass
        except BrokenPipeError:  # the notebook closed the pipes first: the session ends
            pass
        shared_tensors.map_written()  # the cell's report is out: off its time


class Interruptible:
    """The cell a replica thread runs, and how to raise KeyboardInterrupt in it."""

    # In the main thread: how long SIGINT's handler has to raise before SIGINT is sent
    # again (the first time also as an asynchronous exception: see interrupt); within the
    # notebook's grace for an interrupt (2 s).
    RESEND_AFTER = (0.1, 0.2, 0.4, 0.8)
    # How long after a KeyboardInterrupt was swallowed it comes again (see swallowed).
    AGAIN_SECONDS = 0.01

    def __init__(self):
        # Reentrant: SIGINT's handler takes it in the main thread, which may hold it.
        self._lock = threading.RLock()
        self._thread = threading.get_ident()
        self._run_id: Optional[str] = None
        self._ran: Optional[str] = None  # the last cell that ended here
        # An interrupt of a cell that has not started here yet (its run command still
        # not yet read when the interrupt came): the cell is interrupted as it starts.
        self._early: Optional[str] = None
        self._raised = threading.Event()  # SIGINT's handler raised in the running cell
        # The cell the notebook interrupted (SIGINT's handler raises only for it: see
        # _on_sigint).
        self._asked: Optional[str] = None
        self._sent = False  # an asynchronous KeyboardInterrupt was sent to the running cell
        self._main = self._thread == threading.main_thread().ident
        if self._main:
            signal.signal(signal.SIGINT, self._on_sigint)
        _watch_swallowed(self)

    @property
    def busy(self) -> bool:
        """Whether a cell runs here now."""
        return self._run_id is not None

    @contextlib.contextmanager
    def running(self, run_id: str):
        with self._lock:
            self._run_id = run_id
            self._raised.clear()
            self._sent = False
            early, self._early = self._early == run_id, None
        try:
            if early:
                raise KeyboardInterrupt
            yield
        finally:
            with self._lock:
                self._run_id, self._ran = None, run_id
                if self._sent:  # one that came too late is dropped
                    _drop_async_exception(self._thread)

    def interrupt(self, run_id: str) -> None:
        """KeyboardInterrupt in the cell ``run_id``, if this replica still runs it.

        In the main thread, SIGINT (to that thread: it wakes a ``time.sleep`` or a blocked
        read, whose Python code then runs the handler), sent again while the handler has not
        raised and the cell runs (:data:`RESEND_AFTER`): a SIGINT that arrives between the
        check for signals and the system call of a sleep going back to sleep (woken by
        another signal: the notebook asks for the replicas' stacks as it interrupts) is
        taken only when that sleep ends. On Python 3.13, in a replica forked from the
        launcher's thread, the handler was seen never to run while the cell looped in
        Python (the sleep was interrupted): so the interrupt also comes as an asynchronous
        exception, at the cell's next Python line, if the handler has not raised soon.
        """
        # Where the interrupt finds the cell first, if the notebook asked (it does not wait
        # for the answer before it interrupts a session's replicas).
        stacks.answer_asked()
        with self._lock:
            if self._run_id != run_id:
                if self._ran != run_id:  # not started here yet: interrupted as it starts
                    self._early = run_id
                return  # (or over here)
            if not self._main:
                self._send()
                return
            self._asked = run_id
            self._signal()
        for wait in self.RESEND_AFTER:
            if self._raised.wait(wait) or not self._again(run_id, also_async=True):
                return

    def _signal(self) -> None:
        signal.pthread_kill(self._thread, signal.SIGINT)

    def swallowed(self) -> bool:
        """Whether a KeyboardInterrupt that Python reports as unraisable (swallowed) in
        this replica's thread was this one's, for the cell running here; if so it comes
        again, at the cell's next line. The interrupt lands wherever the cell's thread
        runs Python code, also in a finalizer the garbage collector runs in the middle of
        a cell's line (an object's ``__del__``, a generator's ``finally``), and an
        exception raised there is only reported, not raised: the cell slept on, and the
        session ended ("did not stop within 2 s"). It comes again from another thread, a
        moment later: raised now, it would be raised in the hook, and swallowed again."""
        with self._lock:
            if self._run_id is None or not (self._raised.is_set() or self._sent):
                return False
            self._raised.clear()
            run_id = self._run_id
        threading.Timer(self.AGAIN_SECONDS, self._again, args=(run_id,)).start()
        return True

    def _again(self, run_id: str, also_async: bool = False) -> bool:
        """Raise KeyboardInterrupt again in the cell ``run_id``, unless it is over here or
        took one meanwhile; whether it did. In the main thread by SIGINT (with
        ``also_async``, the first time also as an asynchronous exception: see interrupt),
        in another as an asynchronous exception."""
        with self._lock:
            if self._run_id != run_id or self._raised.is_set():
                return False
            if not self._main or (also_async and not self._sent):
                self._send()
            if self._main:
                self._signal()
            return True

    def _send(self) -> None:
        self._sent = True
        _async_raise(self._thread, KeyboardInterrupt)

    def _on_sigint(self, signum, frame):
        # Only the notebook's interrupt of the cell running now: a SIGINT of Jupyter's
        # Interrupt (to the kernel's process group) came before the notebook asked where the
        # replica is, and a cell ended by it would be said to be "not in the cell".
        with self._lock:
            if self._run_id is None or self._raised.is_set() or self._asked != self._run_id:
                return
            self._raised.set()
        raise KeyboardInterrupt


# The Interruptible of each replica thread of this process, for the unraisable hook.
_by_thread: Dict[int, Interruptible] = {}


def _watch_swallowed(interruptible: Interruptible) -> None:
    """Let ``interruptible`` see the KeyboardInterrupts swallowed in its thread
    (:meth:`Interruptible.swallowed`), through ``sys.unraisablehook``, installed once per
    process; every other unraisable exception goes to the hook that was there."""
    import sys

    if not _by_thread:
        previous = sys.unraisablehook

        def hook(unraisable) -> None:
            cell = _by_thread.get(threading.get_ident())
            if (cell is not None and isinstance(unraisable.exc_value, KeyboardInterrupt)
                    and cell.swallowed()):
                return
            previous(unraisable)

        sys.unraisablehook = hook
    _by_thread[interruptible._thread] = interruptible


def _async_raise(thread_id: int, exc_type) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type else None)


class _Dropped(BaseException):
    """The asynchronous exception that replaces one to drop (see _drop_async_exception)."""


def _drop_async_exception(thread_id: int) -> None:
    """Drop the asynchronous exception that may be pending for this thread, ``thread_id``.

    Not with ``PyThreadState_SetAsyncExc(thread_id, NULL)``: up to Python 3.12 that leaves
    the interpreter's flag "an asynchronous exception is pending" set, as only an exception
    taken clears it. Every call and loop of every thread then takes the slow path (later
    cells run slower: bench/results.md, "A session's later cells, after an interrupted
    cell"), and on 3.11 a cell that set and cleared a profiler spun for ever.
    So a harmless exception replaces the pending one, and is taken here.
    """
    try:
        _async_raise(thread_id, _Dropped)
        for _ in range(1000):  # it is taken by then: at the latest, at the first jump back
            pass
    except _Dropped:
        return
    _async_raise(thread_id, None)  # not taken (not seen): it must not come later


class DebugRequest(NamedTuple):
    """``%xla_debug``: the named pipes of the debugger's answers (``input``) and of what
    it writes (``output``), both made by the notebook."""

    input: str
    output: str


def debug(request: DebugRequest, failure) -> None:
    """pdb's post-mortem on ``failure`` (the last cell's exception and the cell's file, or
    None), from the cell's innermost frame, talking through ``request``'s pipes; it ends
    with ``q`` (or ``c``), or when the notebook closes them. The replica then serves
    cells again, its globals as they were."""
    import pdb

    with contextlib.suppress(OSError), open(request.output, "w", buffering=1) as out, \
            open(request.input) as answers:
        if failure is None:
            out.write("This replica's last cell raised nothing: no exception to debug.\n")
            return
        exc, cell_path = failure
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != cell_path:
            tb = tb.tb_next  # (from the cell's frame: colab_xla's are not the cell's)
        out.write(f"{type(exc).__name__}: {exc}\n")
        debugger = pdb.Pdb(stdin=answers, stdout=out, nosigint=True)
        debugger.prompt += pdb_pipes.PROMPT_END  # (how the notebook knows a prompt)
        debugger.use_rawinput = False
        debugger.reset()
        debugger.interaction(None, tb or exc.__traceback__)


class _Commands:
    """The replica's commands: the cells (and a debugger, and the stop) read from the
    command pipe by the replica's own thread as it waits for the next cell, with no thread
    between the pipe and the cell (a reader thread handing it on costs every replica a
    thread switch a cell); interrupts and
    completions from the urgent pipe, by a thread of their own, so that they reach a
    replica busy in its cell (colab_xla.wire.job.urgent_path)."""

    def __init__(self, path: str, urgent: str, interruptible: Interruptible):
        self._interruptible = interruptible
        self.namespace: Optional[Dict] = None  # the session's globals, once a cell ran
        self._fd = _open_pipe(path)
        self._buffered = b""
        self._lines: Deque[bytes] = collections.deque()  # read, not yet taken
        urgent_fd = _open_pipe(urgent)
        threading.Thread(target=self._read_urgent, args=(urgent_fd,),
                         name="colab_xla-session-commands", daemon=True).start()

    def next(self) -> Union[ReplicaJob, DebugRequest, None]:
        """The next cell's job (or a debugger to run); None when the session ends (``stop``,
        or the notebook gone). A line of a verb this replica does not know is passed over,
        as the urgent pipe's are. While it waits, the pages of results the notebook has
        removed are let go of."""
        while True:
            line = self._next_line()
            if line is None:  # the notebook is gone
                return None
            verb, _, arg = line.decode().partition(" ")
            if verb in JOB_VERBS:
                return job_from_command(verb, arg)
            if verb == "debug":
                return DebugRequest(*arg.split(" ", 1))
            if verb == "stop":
                return None

    def _next_line(self) -> Optional[bytes]:
        """The command pipe's next line; None once the notebook is gone (its end closed)."""
        while not self._lines:
            if not select.select([self._fd], [], [], shared_tensors.KEPT_CHECK_SECONDS)[0]:
                shared_tensors.let_go_removed()
                continue
            try:
                data = os.read(self._fd, 4096)
            except OSError:
                data = b""
            if not data:
                return None
            *lines, self._buffered = (self._buffered + data).split(b"\n")
            self._lines.extend(lines)
        return self._lines.popleft()

    def _read_urgent(self, fd: int) -> None:
        buffered = b""
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            if not data:  # the notebook is gone
                return
            *lines, buffered = (buffered + data).split(b"\n")
            for line in lines:
                verb, _, arg = line.decode().partition(" ")
                if verb == "interrupt":
                    self._interruptible.interrupt(arg)
                elif verb == "complete":  # not in this thread's way: a dir() that blocks
                    # (a user's __dir__) must not hold interrupts
                    path, _, expr = arg.partition(" ")
                    threading.Thread(target=completions.answer, name="colab_xla-complete",
                                     args=(path, expr, self.namespace,
                                           self._interruptible.busy), daemon=True).start()


def _open_pipe(path: str) -> int:
    """Open the named pipe ``path`` to read: the notebook made it and holds the other
    end, or (a replica the notebook could not count before the start: see Session) made
    here, and open for writing too until the notebook opens it."""
    if os.path.exists(path):
        return os.open(path, os.O_RDONLY)
    os.mkfifo(path, 0o600)
    return os.open(path, os.O_RDWR)
