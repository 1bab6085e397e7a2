"""C-level output handed on a line at a time: :class:`PartialLines` holds a line's pieces.

C stdio may write one line in pieces (a printf's text, then its conversion), and a Python
line the replica prints next, which comes another way (a frame), must not land inside it.
So the text read from a process's fd 1 or 2 is shown up to its last line end, and the
rest is held until its line ends, or for :data:`PARTIAL_LINE_SECONDS` at most (then it is
shown as it is: a prompt, say). The holder keeps the pieces and says what to show and
when; showing it is the caller's (:class:`colab_xla.notebook.supervisor.Supervisor`).

>>> held = PartialLines()
>>> held.ended(7, 0, 1, "loss 0.5\\nepoch ", now=10.0)
'loss 0.5\\n'
>>> held.due()
10.2
>>> held.ended(7, 0, 1, "2\\n")
'epoch 2\\n'
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, NamedTuple, Optional

# How long the piece of an unended line is held at most.
PARTIAL_LINE_SECONDS = 0.2


class Held(NamedTuple):
    """The piece of a C-level line read so far (its line not ended yet)."""
    text: str
    origin: Any  # whose output it is, as read (shown under it if it is shown unended)
    kind: int
    since: float  # monotonic time of its first read


class PartialLines:
    """The held pieces of C-level lines, by the pipe (fd) they were read from. ``pieces``
    is empty when nothing is held (the read loop checks it without a call)."""

    def __init__(self) -> None:
        self.pieces: Dict[int, Held] = {}

    def ended(self, fd: int, origin, kind: int, text: str,
              now: Optional[float] = None) -> str:
        """``text`` was read from ``fd``: what is shown now (its ended lines, after the piece
        held before them), holding the rest. A line ends with ``\\n`` or ``\\r`` (a progress
        line's end). ``now`` (monotonic; read if not given) dates a new held piece."""
        held = self.pieces.pop(fd, None)
        if held:
            text = held.text + text
        end = max(text.rfind("\n"), text.rfind("\r")) + 1
        if end < len(text):
            since = held.since if held else (time.monotonic() if now is None else now)
            self.pieces[fd] = Held(text[end:], origin, kind, since)
        return text[:end]

    def due(self) -> float:
        """When the oldest held piece is to be shown (call only while ``pieces`` holds one)."""
        return min(held.since for held in self.pieces.values()) + PARTIAL_LINE_SECONDS

    def release(self, now: Optional[float] = None) -> List[Held]:
        """Let go of the pieces held :data:`PARTIAL_LINE_SECONDS` or longer at ``now`` (every
        piece if ``now`` is None), to be shown as they are, in the order their pipes were
        last read."""
        before = None if now is None else now - PARTIAL_LINE_SECONDS
        out = []
        for fd, held in list(self.pieces.items()):
            if before is None or held.since <= before:
                del self.pieces[fd]
                out.append(held)
        return out
