"""Where a replica is: its stack, taken on demand from outside, even while it is blocked in
native code (a collective waiting in gloo, XLA or NCCL), and said as a place in the cell.

Both sides, IPython-free:

* in every replica process, :func:`register` makes Python's faulthandler write the stack of
  every thread of the process to a file of the run when the process gets :data:`SIGNAL` (at
  C level: no Python code of the process has to run for it);
* in the notebook, :func:`ask` sends the signal to the processes of the replicas still
  running, reads what they wrote, and :func:`place` says, from a replica thread's frames,
  where in the cell it is: the cell's line (``line 7``), the cell's function it is in, the
  line's source, and the innermost call outside the cell (``in all_reduce
  (torch/distributed/distributed_c10d.py:2950)``); :func:`grouped` puts the replicas at the
  same place together.

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

import io
import os
import re
import signal
import time
import tokenize
from typing import Collection, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

# The signal a replica process answers with the stacks of its threads (faulthandler's).
SIGNAL = signal.SIGUSR2
# How long the notebook waits for the stacks of every process it asked.
TAKE_SECONDS = 1.0
# A dump is whole when its file has not been written for this long; the notebook looks
# this often.
QUIET_SECONDS = 0.01
POLL_SECONDS = 0.002

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
# Frames of these are colab_xla's own plumbing, never a place worth naming.
_OWN = os.sep + "colab_xla" + os.sep
_PACKAGES = re.compile(r"/(?:site|dist)-packages/|/lib/python\d+\.\d+/(?!(?:site|dist)-)")

_registered: List = []  # the open file faulthandler writes to (kept alive)


class Frame(NamedTuple):
    filename: str
    line: int
    function: str


def path(directory: str, pid: int) -> str:
    """The file replica process ``pid`` writes its stacks to, in ``directory`` (its run's,
    or the one its session's cells share: removed with it)."""
    return os.path.join(directory, f"stacks-{pid}.txt")


def register(directory: str) -> str:
    """In a replica process: write the stacks of every thread to :func:`path` on
    :data:`SIGNAL`; returns the path (the notebook learns it from the replica's start)."""
    import faulthandler

    target = path(directory, os.getpid())
    if registered() == target:
        return target
    stream = open(target, "w")  # noqa: SIM115 - open for the process's life
    faulthandler.register(SIGNAL, file=stream, all_threads=True, chain=False)
    _registered[:] = [stream]
    return target


def registered() -> Optional[str]:
    """The file this process writes its stacks to (:func:`register`), or None."""
    return _registered[0].name if _registered else None


class Asked(NamedTuple):
    """Processes asked for their stacks (:func:`ask`): pid -> its stacks file, and the file's
    size before."""
    files: Mapping[int, str]
    sizes: Dict[int, int]
    at: float  # time.monotonic() when asked


def ask(files: Mapping[int, str]) -> Asked:
    """In the notebook: send each process ``pid`` of ``files`` (pid -> its stacks file) the
    signal that makes it write its stacks. It writes them as the signal arrives, before it
    runs another line of Python: a process interrupted right after still writes where it
    was, so :func:`collect` may come later (after the replicas were stopped)."""
    sizes: Dict[int, int] = {}
    for pid, name in files.items():
        try:
            sizes[pid] = os.path.getsize(name)
            os.kill(pid, SIGNAL)
        except OSError:  # (gone, or never registered)
            sizes.pop(pid, None)
    return Asked(files, sizes, time.monotonic())


def collect(asked: Asked, timeout: float = TAKE_SECONDS,
            moved_on: Collection[int] = ()) -> Dict[int, str]:
    """``{pid: what it wrote}`` for the processes :func:`ask` asked that answered within
    ``timeout`` of being asked. A dump is whole once its file has grown and then not been
    written for :data:`QUIET_SECONDS` (faulthandler writes no end mark), or at once for a
    process in ``moved_on``: one that has run Python code since it was asked (it reported
    the end of its cell), so it has written the whole dump."""
    sizes = dict(asked.sizes)
    taken: Dict[int, str] = {}
    deadline = asked.at + timeout
    while sizes:
        for pid, before in list(sizes.items()):
            try:
                stat = os.stat(asked.files[pid])
            except OSError:
                sizes.pop(pid)
                continue
            if stat.st_size > before and (pid in moved_on
                                          or time.time() - stat.st_mtime >= QUIET_SECONDS):
                with open(asked.files[pid], "rb") as stream:
                    stream.seek(before)
                    taken[pid] = stream.read(stat.st_size - before).decode("utf-8",
                                                                           "replace")
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

