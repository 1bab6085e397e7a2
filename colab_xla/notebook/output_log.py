"""A replica's output as the notebook keeps it: a bounded tail in memory, all of it in a file.

Text arrives in chunks that may split lines anywhere. :class:`OutputLog` joins them into
lines per stream, collapses carriage returns the way a terminal shows them (a tqdm bar
updated in place becomes one line), keeps the last ``tail_lines`` lines for views, and
appends everything to a log file, so a replica printing millions of lines cannot exhaust
the kernel's memory or the browser.

Example::

    >>> log = OutputLog(path=None, tail_lines=2)
    >>> log.write("stdout", "a\\nb\\n 10%\\r 50%\\r100%\\nc")
    ['a', 'b', '100%']
    >>> log.tail_text(), log.lines_total
    ('b\\n100%\\nc', 3)
"""

from __future__ import annotations

import collections
import io
import os
from typing import Deque, Dict, List, Optional, Tuple

from . import state

TAIL_LINES = 400
# How much of a line not yet ended a view shows: its last characters (the log file and,
# once the line ends, the tail have all of it).
PARTIAL_SHOWN = 1 << 14


def collapse_cr(line: str) -> str:
    """What a terminal shows for a line rewritten with ``\\r``: its last non-empty part."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


def shorten(line: str, limit: int = PARTIAL_SHOWN) -> str:
    """A line as a view that redraws it on every tick shows it: its start, if long."""
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… [{len(line) - limit} more characters in the log]"


class BarLine(str):
    """The last line of a tqdm bar left as it ended (``leave``), among its replica's output:
    every view shows it there but the widget's replica tab, whose state draws the bar
    itself."""


class OutputLog:
    """Lines of one replica (or one process), in arrival order, stdout and stderr."""

    def __init__(self, path: Optional[str], tail_lines: int = TAIL_LINES):
        self.path = path
        self.tail: Deque[Tuple[str, str]] = collections.deque(maxlen=tail_lines)
        self.lines_total = 0
        # Per stream, the chunks of the line not yet ended by a newline: kept as a list
        # and joined once when the line ends, so a line that arrives in many chunks costs
        # its length, not its length times the number of chunks.
        self._partial: Dict[str, List[str]] = {}
        self._file: Optional[io.TextIOBase] = None
        self.written = False  # whether a line went to the file
        self.version = 0  # bumps on every change; views redraw only what changed

    def write(self, stream: str, text: str) -> List[str]:
        """Add a chunk; return the lines it completed (``\\r`` collapsed)."""
        if not text:
            return []
        self.version += 1
        self._append_file(text)
        if "\n" not in text:
            self._partial.setdefault(stream, []).append(text)
            return []
        pieces = text.split("\n")
        pieces[0] = "".join(self._partial.pop(stream, ())) + pieces[0]
        if pieces[-1]:
            self._partial[stream] = [pieces[-1]]
        done = [collapse_cr(p) for p in pieces[:-1]]  # a \r may have come in an earlier chunk
        self.tail.extend((stream, line) for line in done[-self.tail.maxlen:])
        self.lines_total += len(done)
        return done

    def display(self, shown: str) -> str:
        """Add a displayed object (a :class:`colab_xla.wire.displays.Display`: a line whose
        text is its text form) as a line of stdout, after the lines before it."""
        self.version += 1
        self._append_file(f"{shown}\n")
        self.tail.append(("stdout", shown))
        self.lines_total += 1
        return shown

    def bar_ended(self, text: str) -> BarLine:
        """Add a left bar's last line (:class:`BarLine`), as tqdm writes it: on stderr,
        after the lines before it (a line of stderr not yet ended stays so)."""
        line = BarLine(text)
        self.version += 1
        self._append_file(f"{line}\n")
        self.tail.append(("stderr", line))
        self.lines_total += 1
        return line

    def items(self) -> List[str]:
        """The kept lines, then those not yet ended, as shown now (displays among them)."""
        return [t for _, t in self.tail] + [t for _, t in self.partial()]

    def partial(self) -> List[Tuple[str, str]]:
        """Lines not yet ended by a newline (a progress bar, say), as shown now."""
        shown = []
        for stream, chunks in list(self._partial.items()):  # (a host's agent reads it too)
            # Only the end of the line: a view draws it on every tick while it grows.
            recent, size = [], 0
            for chunk in reversed(chunks):
                recent.append(chunk)
                size += len(chunk)
                if size >= PARTIAL_SHOWN:
                    break
            text = "".join(reversed(recent))
            cut = len(text) > PARTIAL_SHOWN or len(recent) < len(chunks)
            line = collapse_cr(text[-PARTIAL_SHOWN:])
            if line:
                shown.append((stream, "… " + line[2:] if cut and "\r" not in text else line))
        return shown

    def show_partial(self, shown: List[Tuple[str, str]]) -> None:
        """Show ``shown`` as the lines not yet ended, in place of this log's: what
        another process's log shows of its own (a cluster host's, which sends its
        replicas' ended lines separately)."""
        if shown or self._partial:
            self.version += 1
        self._partial = {stream: [text] for stream, text in shown}

    def finish(self) -> List[str]:
        """End the log: a last line without newline counts as a line. Returns those lines."""
        done = []
        for stream, chunks in list(self._partial.items()):
            line = collapse_cr("".join(chunks))
            self.tail.append((stream, line))
            done.append(line)
        self.lines_total += len(done)
        self._partial.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
        return done

    @property
    def truncated(self) -> int:
        """How many lines are in the log file but no longer in the tail."""
        return max(0, self.lines_total - len(self.tail))

    def earlier_note(self, skipped: Optional[int] = None) -> str:
        """``... N earlier lines in <path>``: what a view shows above the lines it keeps
        (``skipped`` defaults to the lines this log no longer holds)."""
        return f"... {self.truncated if skipped is None else skipped} earlier lines in {self.path}"

    def tail_text(self) -> str:
        return "\n".join(self.items())

    def _append_file(self, text: str) -> None:
        if self.path is None:
            return
        if self._file is None:
            if not self.written:  # the run's first line logged: its directory
                state.make_log_dir(os.path.dirname(self.path))
            self._file = open(self.path, "a", encoding="utf-8", errors="replace",
                              opener=state.private_file)
            self.written = True
        self._file.write(text)
