"""Where a replica is: its stack, taken on demand from outside, also while it waits in
native code (a collective waiting in gloo, XLA or NCCL, a sleep), and said as a place in the
cell.

Both sides, IPython-free:

* in every replica process, :func:`register` starts a thread that answers each byte written
  to the process's ask pipe (a named pipe beside its stacks file) with the stacks of every
  other thread of the process, taken under Python's lock (``sys._current_frames``), appended
  to its stacks file in faulthandler's format and closed by :data:`END`;
* in the notebook, :func:`ask` writes to the ask pipes of the processes of the replicas still
  running, :func:`collect` reads what they wrote, and :func:`place` says, from a replica
  thread's frames, where in the cell it is: the cell's line (``line 7``), the cell's
  function it is in, the line's source, and the innermost call outside the cell (``in
  all_reduce (torch/distributed/distributed_c10d.py:2950)``); :func:`grouped` puts the
  replicas at the same place together.

Not faulthandler on a signal, which colab_xla used before: its handler walks the other
threads' frames without Python's lock, while they run and free them, and it crashed the
process (SIGSEGV) when another thread ran Python meanwhile, as a session replica's command
thread does as the interrupt that follows the question arrives (a probe that asked and
interrupted a sleeping main thread in a loop died within a few hundred rounds, on Python
3.11, 3.12 and 3.13). The thread answers whenever Python's lock is free: when the replica
runs Python, or waits in native code that lets go of it, as collectives, sleeps and XLA's
waits do. A replica whose native code keeps the lock does not answer, and its place says
so (:data:`UNANSWERED`).

Example::

    >>> dump = '''Thread 0x00007f0c1a7fc640 (most recent call first):
    ...   File "/x/site-packages/torch/distributed/c10d.py", line 2950 in all_reduce
    ...   File "/tmp/run/cell_1.py", line 7 in step
    ...   File "/tmp/run/cell_1.py", line 9 in <module>
    ...   File "/x/colab_xla/replica/execution.py", line 120 in _run_cell
    ... '''
    >>> frames = parse(dump)[0x7f0c1a7fc640]
    >>> place(frames, "/tmp/run/cell_1.py", [""] * 6 + ["    dist.all_reduce(t)"])
    'line 7 in step: `dist.all_reduce(t)` (in all_reduce, torch/distributed/c10d.py:2950)'
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import select
import sys
import threading
import time
import tokenize
from types import FrameType
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

# How long the notebook waits for the stacks of every process it asked.
TAKE_SECONDS = 1.0
# How often the notebook looks whether they have come.
POLL_SECONDS = 0.002
# What closes each dump: the notebook reads one only once it is whole.
END = "-- end of stacks --\n"
# The place of a replica whose process was asked and did not answer in time.
UNANSWERED = (f"an unknown place: its process did not answer within {TAKE_SECONDS:g} s "
              "(native code that keeps Python's lock, such as a C extension's long loop, "
              "keeps it from answering; a native profiler on its process while it runs, "
              "such as `py-spy dump --native --pid PID`, shows where)")
# The innermost frames of a thread a dump gives at most (faulthandler's gave 100).
MAX_FRAMES = 500

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
# Frames of these are colab_xla's own plumbing, never a place worth naming.
_OWN = os.sep + "colab_xla" + os.sep
_PACKAGES = re.compile(r"/(?:site|dist)-packages/|/lib/python\d+\.\d+/(?!(?:site|dist)-)")


class _Answerer(NamedTuple):
    """This process's side (:func:`register`): its stacks file, the read end of its ask pipe
    (non-blocking), the stacks file's fd, the lock that makes each question answered once,
    before whoever read it goes on, and the stacks thread (left out of the answers)."""
    target: str
    asked: int
    answers: int
    lock: threading.Lock
    thread: threading.Thread


_registered: List[_Answerer] = []  # (one, once the process registered)


class Frame(NamedTuple):
    filename: str
    line: int
    function: str


def path(directory: str, pid: int) -> str:
    """The file replica process ``pid`` writes its stacks to, in ``directory`` (its run's,
    or the one its session's cells share: removed with it)."""
    return os.path.join(directory, f"stacks-{pid}.txt")


def ask_path(stacks_file: str) -> str:
    """The named pipe a process reads its questions from, beside its ``stacks_file``."""
    return stacks_file[:-len(".txt")] + ".ask"


def register(directory: str) -> Optional[str]:
    """In a replica process: answer each question on :func:`ask_path` with the stacks of
    the process's threads, appended to :func:`path`; returns that path (the notebook
    learns it from the replica's start). Where its files cannot be made, it keeps what it
    had and returns :func:`registered` (None the first time: the replica's place is not
    said)."""
    target = path(directory, os.getpid())
    if registered() == target:
        return target
    question = ask_path(target)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(question)
        os.mkfifo(question, 0o600)
        # Read and write: the pipe never reads as ended while the notebook's writers come
        # and go.
        asked = os.open(question, os.O_RDWR | os.O_NONBLOCK)
    except OSError:  # (a filesystem without named pipes)
        return registered()
    try:
        answers = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    except OSError:
        os.close(asked)
        return registered()
    thread = threading.Thread(target=_answer, name="colab_xla-stacks", daemon=True)
    before, _registered[:] = _registered[:], [
        _Answerer(target, asked, answers, threading.Lock(), thread)]
    thread.start()
    for old in before:  # (another directory: its thread ends, woken through its own pipe)
        with contextlib.suppress(OSError):
            os.write(old.asked, b"!")
    return target


def registered() -> Optional[str]:
    """The file this process writes its stacks to (:func:`register`), or None."""
    return _registered[0].target if _registered else None


def answer_asked() -> None:
    """Answer the questions written to this process's ask pipe and not read yet, now, in
    the calling thread; return once they are answered (by this thread or the stacks
    thread). A session replica calls it before it takes an interrupt, so its stacks say
    where the interrupt found it, though the notebook did not wait for them."""
    if _registered:
        _answer_once(_registered[0])


def _answer_once(side: _Answerer) -> None:
    """Answer the questions not read yet, if any. The questions are read first: whatever
    fails after it, the stacks thread's poll does not wake for them again (no spin)."""
    with side.lock:
        try:
            if not os.read(side.asked, 64):
                return
        except BlockingIOError:  # (none, or already answered)
            return
        data = dump(sys._current_frames(), leave_out=side.thread.ident)
        data = data.encode("utf-8", "replace")
        while data:
            data = data[os.write(side.answers, data):]


def _answer() -> None:
    """The stacks thread: a dump for each read of questions (several asked at once get one)."""
    side = _registered[0]
    poll = select.poll()  # (not select.select: a replica may hold 1,024 fds and more)
    poll.register(side.asked, select.POLLIN)
    while True:
        try:
            poll.poll()
            if _registered[0] is not side:  # registered again, elsewhere: this one is done
                os.close(side.asked)
                os.close(side.answers)
                return
            _answer_once(side)
        except OSError:  # (its directory is gone: the run or session is over)
            return
        except Exception:  # noqa: BLE001 - no answer this time (the notebook moves on)
            continue


def dump(frames: Mapping[int, FrameType], leave_out: Optional[int] = None) -> str:
    """``frames`` (thread ident -> its innermost frame, as ``sys._current_frames()``
    gives them) in faulthandler's format, innermost first, closed by :data:`END`."""
    threads = []
    for ident, frame in frames.items():
        if ident == leave_out:
            continue
        lines = [f"Thread 0x{ident:016x} (most recent call first):"]
        while frame is not None and len(lines) <= MAX_FRAMES:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno or 0} in '
                         f"{code.co_name}")
            frame = frame.f_back
        threads.append("\n".join(lines) + "\n")
    return "\n".join(threads) + END


class Asked(NamedTuple):
    """Processes asked for their stacks (:func:`ask`): pid -> its stacks file, and the file's
    size before."""
    files: Mapping[int, str]
    sizes: Dict[int, int]
    at: float  # time.monotonic() when asked


def ask(files: Mapping[int, str]) -> Asked:
    """In the notebook: ask each process ``pid`` of ``files`` (pid -> its stacks file) for
    its stacks. A process whose ask pipe has no reader (gone, or never registered) is not
    asked. The answers are where the process is when its stacks thread runs, a moment
    later: wait for them (:func:`collect`) before killing it, or have it answer before it
    takes the interrupt (:func:`answer_asked`, as a session replica does)."""
    sizes: Dict[int, int] = {}
    for pid, name in files.items():
        try:
            sizes[pid] = os.path.getsize(name)
            fd = os.open(ask_path(name), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # (gone: its files, or the reader of its pipe)
            sizes.pop(pid, None)
            continue
        try:
            os.write(fd, b"?")
        except BlockingIOError:  # questions it has not read yet: it answers them all
            pass
        except OSError:
            sizes.pop(pid)
        finally:
            os.close(fd)
    return Asked(files, sizes, time.monotonic())


def collect(asked: Asked, timeout: float = TAKE_SECONDS) -> Dict[int, str]:
    """``{pid: what it wrote}`` for the processes :func:`ask` asked that answered within
    ``timeout`` of being asked: each whole dump (closed by :data:`END`) they wrote since."""
    sizes = dict(asked.sizes)
    taken: Dict[int, str] = {}
    deadline = asked.at + timeout
    while sizes:
        for pid, before in list(sizes.items()):
            try:
                with open(asked.files[pid], "rb") as stream:
                    stream.seek(before)
                    text = stream.read().decode("utf-8", "replace")
            except OSError:
                sizes.pop(pid)
                continue
            if text.endswith(END):
                taken[pid] = text
                sizes.pop(pid)
        if not sizes or time.monotonic() >= deadline:
            break
        time.sleep(POLL_SECONDS)
    return taken


def parse(dump: str) -> Dict[int, List[Frame]]:
    """faulthandler's dump: ``{thread ident: frames, innermost first}``."""
    threads: Dict[int, List[Frame]] = {}
    frames: Optional[List[Frame]] = None
    for text in dump.splitlines():
        header = _THREAD.match(text)
        if header:
            frames = threads.setdefault(int(header.group(1), 16), [])
            continue
        frame = _FRAME.match(text)
        if frame and frames is not None:
            frames.append(Frame(frame["file"], int(frame["line"]), frame["function"]))
    return threads


def place(frames: Sequence[Frame], cell_file: str, cell_lines: Sequence[str]) -> str:
    """Where a replica whose thread's frames (innermost first) are ``frames`` is, in the
    cell whose module is ``cell_file`` and whose source lines are ``cell_lines``: the
    innermost line of the cell, and the call it is in: the innermost of the frames it
    called (past colab_xla's wrappers of them), down to colab_xla's own (the CPU
    simulation's collectives: the torch_xla call the cell made is named instead)."""
    in_cell = next((i for i, f in enumerate(frames) if f.filename == cell_file), None)
    if in_cell is None:
        theirs = [f for f in frames if _OWN not in f.filename]
        return "not in the cell" + (f" (in {_call(theirs[0])})" if theirs else "")
    here = frames[in_cell]
    called = None
    for frame in reversed(frames[:in_cell]):  # from the cell inwards, past its wrappers
        if _OWN not in frame.filename:
            called = frame
        elif called is not None:
            break
    source = _code(cell_lines[here.line - 1]) if 0 < here.line <= len(cell_lines) else ""
    said = f"line {here.line}"
    if here.function != "<module>":
        said += f" in {here.function}"
    if source:
        said += f": `{source}`"
    return f"{said} (in {_call(called)})" if called else said


def _code(line: str) -> str:
    """A line of the cell without its comment (``x = f()  # why`` -> ``x = f()``)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return line.strip()  # (a line of a longer statement: as it is)
    comment = next((t for t in tokens if t.type == tokenize.COMMENT), None)
    return (line.strip()[:comment.start[1]] if comment else line.strip()).rstrip()


def _call(frame: Frame) -> str:
    """A frame as ``function, package/path.py:line``."""
    return f"{frame.function}, {_short(frame.filename)}:{frame.line}"


def _short(filename: str) -> str:
    """A file as a person reads it: from its package (after site-packages, or the standard
    library's directory), else its name."""
    parts = _PACKAGES.split(filename)
    return parts[-1] if len(parts) > 1 else os.path.basename(filename)


def grouped(places: Mapping[int, str]) -> List[Tuple[str, List[int]]]:
    """``[(place, sorted ordinals at it)]``, in the order of their lowest ordinal."""
    groups: Dict[str, List[int]] = {}
    for ordinal in sorted(places):
        groups.setdefault(places[ordinal], []).append(ordinal)
    return list(groups.items())


def places(answers: Mapping[int, str], asked: Asked, threads: Mapping[int, Tuple[int, int]],
           cell_file: str, cell_lines: Sequence[str]) -> Dict[int, str]:
    """``{ordinal: place}`` of each replica (``threads``: ordinal -> (pid, thread ident))
    whose process answered (``answers``: :func:`collect`'s), and :data:`UNANSWERED` for one
    whose process was asked and did not answer. A replica whose process answered without
    its thread (it ended meanwhile) or was not asked (its pipe could not be made) has
    none."""
    found = {o: place(frames, cell_file, cell_lines)
             for o, frames in of_threads(answers, threads).items()}
    found.update({o: UNANSWERED for o, (pid, _) in threads.items()
                  if pid in asked.sizes and pid not in answers})
    return found


def of_threads(dumps: Mapping[int, str],
               threads: Mapping[int, Tuple[int, int]]) -> Dict[int, List[Frame]]:
    """``{ordinal: frames}`` of each replica (``threads``: ordinal -> (pid, thread
    ident)) whose process answered (``dumps``: pid -> its dump)."""
    parsed = {pid: parse(text) for pid, text in dumps.items()}
    found: Dict[int, List[Frame]] = {}
    for ordinal, (pid, ident) in threads.items():
        frames = parsed.get(pid, {}).get(ident)
        if frames:
            found[ordinal] = frames
    return found

