"""What a session's replicas send outside any cell, read all the time:
:class:`SessionChannel`.

Between cells (and while they start) a replica writes to the session's own pipes: frames
on the channel (its Python output, and its notes: ``ready`` once it is up) and C-level
output on the startup pipe. A thread reads both for as long as the session is up, so a
replica that prints between cells (a thread of its own, a library's warning) never blocks
on a full pipe; its notes go to whoever waits for them (:meth:`SessionChannel.notes`), and
the last lines are kept (:meth:`SessionChannel.printed`): what a replica said before it
died, for the message that it died and for ``%xla_session``'s status.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import json
import os
import select
import threading
import time
from typing import Deque, Dict, List

from ...wire import frames

# The lines kept of what the replicas printed outside any cell.
KEPT_LINES = 40


class SessionChannel:
    """The session's channel and startup pipe in ``directory`` (made here), read by a
    thread until :meth:`close`."""

    def __init__(self, directory: str):
        self.channel_path = os.path.join(directory, "channel")
        self.startup_path = os.path.join(directory, "startup")
        self._channel = frames.make_fifo(self.channel_path)
        self._startup = frames.make_fifo(self.startup_path)
        self._decoder = frames.FrameDecoder()
        self._text: Dict[object, codecs.IncrementalDecoder] = {}  # by origin
        self._partial: Dict[object, str] = {}  # an unended line, by origin
        self._lines: Deque[str] = collections.deque(maxlen=KEPT_LINES)
        self._notes: List[dict] = []
        self._changed = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._read, name="colab_xla-session-output",
                                        daemon=True)
        self._thread.start()

    def notes(self, wait: float) -> List[dict]:
        """The notes replicas sent since the last call (each with its ``ordinal``), after
        waiting up to ``wait`` seconds for one."""
        deadline = time.monotonic() + wait
        with self._changed:
            while not self._notes and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            notes, self._notes = self._notes, []
        return notes

    def printed(self, settle: float = 0.5) -> List[str]:
        """The last lines the replicas printed outside any cell, an unended one last; what
        the pipes hold is read first (for up to ``settle`` seconds)."""
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline and self._thread.is_alive():
            try:
                if not select.select([self._channel[0], self._startup[0]], [], [], 0)[0]:
                    break  # drained
            except (OSError, ValueError):  # closed
                break
            time.sleep(0.01)  # (the reader thread takes it)
        with self._changed:
            return list(self._lines) + [f"{_label(origin)}{text}"
                                        for origin, text in self._partial.items() if text]

    def close(self) -> None:
        """Stop reading, and close the pipes (what is left unread is dropped)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(2.0)
        for fd in (*self._channel, *self._startup, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read(self) -> None:
        fds = [self._channel[0], self._startup[0], self._wake_r]
        while True:
            try:
                readable, _, _ = select.select(fds, [], [])
            except OSError:  # closed under it
                return
            if self._wake_r in readable:
                return
            for fd in readable:
                data = os.read(fd, 1 << 16)
                with self._changed:
                    if fd == self._startup[0]:
                        self._keep(None, data)
                        continue
                    for frame in self._decoder.feed(data):
                        if frame.kind == frames.NOTE:
                            self._notes.append({**json.loads(frame.payload),
                                                "ordinal": frame.ordinal})
                            self._changed.notify_all()
                        elif frame.kind in frames.STREAMS:
                            self._keep(frame.ordinal if frame.ordinal >= 0 else None,
                                       frame.payload)

    def _keep(self, origin, data: bytes) -> None:
        decoder = self._text.get(origin)
        if decoder is None:
            decoder = self._text[origin] = codecs.getincrementaldecoder("utf-8")("replace")
        *ended, rest = (self._partial.get(origin, "") + decoder.decode(data)).split("\n")
        self._lines.extend(_label(origin) + line for line in ended)
        self._partial[origin] = rest


def _label(origin) -> str:
    return "" if origin is None else f"[replica {origin}] "
