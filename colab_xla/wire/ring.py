"""A replica process's output ring: frames in a shared memory map, no system call per line.

A replica that prints fast would pay a ``write(2)`` per line on the frame pipe
(:mod:`colab_xla.wire.frames`). Instead, during a run each replica process appends
its frames (the same bytes as on the pipe) to a ring: a file in the run's directory, mapped
shared by the process (:class:`RingWriter`) and by the notebook (:class:`RingReader`). What a
``print`` appended is in the page cache the moment the call returns, so the notebook reads it
even if the process is killed (SIGKILL, ``os._exit``, a segfault) right after.

The pipe still carries a frame naming the ring (:data:`RING`, sent once, before the ring is
used) and wake-ups (:data:`WAKE`): the reader sets the ring's *waiting* flag before it sleeps
in ``select``; a writer that appends while the flag is set clears it and writes one wake-up
frame (a replica's end always does: see :meth:`RingWriter.append`). While the reader keeps
up, lines cost no system call at all. A full ring makes the writer wait for the reader (as a
full pipe would), polling every few milliseconds.

Lines of one stream of one replica, one after another (a ``print`` loop), go in as a *run*
(:meth:`RingWriter.append_run`): the frame header that opens it, then each line's bytes as
they are, until :data:`RUN_END`, a byte that UTF-8 text never holds. The reader takes all
of a run it finds in one slice (:class:`colab_xla.wire.frames.FrameDecoder`): framed one
by one, the lines cost the notebook more to decode than anything else it did with them.

Layout: a 64-byte header (``write`` and ``read`` positions, u64, counting bytes since the
start; the *waiting* flag; the *closed* flag, set by the reader when the run is over) then
``size`` bytes of data. Only the writer stores ``write``, only the reader ``read``; each
stores its position, one aligned 8-byte store, after the bytes it covers. (Stores in one
process become visible to the other in order on x86-64, TPU VMs' and Colab's CPUs; the
bounded ``select`` of the reader covers a wake-up lost to store reordering.)
"""

from __future__ import annotations

import mmap
import os
import threading
import time

# Frame kinds on the pipe (see frames.py for the others).
RING, WAKE = 6, 7
# Ends a run (see above): never in UTF-8 text, so never in a line of a run.
RUN_END = b"\xfe"

DEFAULT_SIZE = 1 << 20  # per replica process: a burst of ~70,000 short lines
_HEADER_SIZE = 64
_WRITE, _READ = 0, 1  # indexes of the u64 positions
_WAITING, _CLOSED = 16, 17  # offsets of the flag bytes
_WAIT_MIN, _WAIT_MAX = 0.0005, 0.01  # how often a writer looks for room in a full ring


class RingClosed(BrokenPipeError):
    """The notebook stopped reading this ring (its run is over)."""


class RingWriter:
    """The replica side. ``append`` and ``append_run`` are thread-safe; the process that
    created the ring is its only writer (a child forked from it writes to the pipe instead:
    see frames.py)."""

    def __init__(self, path: str, size: int = DEFAULT_SIZE):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Every page now (OSError if there is no room): a page a print touched first
            # on a full file system would kill the process with SIGBUS.
            os.posix_fallocate(fd, 0, _HEADER_SIZE + size)
            self._map = mmap.mmap(fd, _HEADER_SIZE + size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.path, self.size = path, size
        self._data = memoryview(self._map)[_HEADER_SIZE:]
        # The positions as native aligned u64s: one load or store each, never torn (struct
        # packs byte by byte: the reader once saw half a new position and read garbage).
        self._pos = memoryview(self._map)[:16].cast("Q")
        self._written = 0
        self._room = size  # known free bytes (at least)
        self._run = None  # the key of the run the last append continued or opened
        self._lock = threading.Lock()
        self.pid = os.getpid()

    def append(self, data: bytes, wake, urgent: bool = False, lazy: bool = False) -> None:
        """Append ``data`` (whole frames, at most ``size`` bytes); call ``wake()`` if the
        reader is waiting for output, or if ``urgent`` (a frame the reader waits for: while
        output flows it looks only every few milliseconds, without asking for a wake-up);
        never if ``lazy`` (a frame nobody waits for: read with the next one that wakes the
        reader, or at its next look, within its poll). Raises :class:`RingClosed` once the
        reader is gone."""
        with self._lock:
            if self._run is not None:
                data = RUN_END + data
            self._append(data, wake, None, urgent, lazy)

    def append_run(self, key, payload: bytes, opening, wake) -> None:
        """Append ``payload`` (no RUN_END in it) to the run of ``key``: as it is if the
        last append was of that run, else after ``opening(key)``, the frame header that
        opens it (and RUN_END, ending the run before)."""
        with self._lock:
            if key != self._run:
                payload = (b"" if self._run is None else RUN_END) + opening(key) + payload
            self._append(payload, wake, key)

    def _append(self, data: bytes, wake, run, urgent: bool = False,
                lazy: bool = False) -> None:
        need = len(data)
        if need > self.size:
            raise ValueError(f"{need} bytes do not fit in a ring of {self.size}")
        m = self._map
        if m is None:
            raise RingClosed("the ring was closed")
        written, size = self._written, self.size
        if self._room < need:  # (what the reader has read may make room)
            self._room = size - (written - self._pos[_READ])
            if self._room < need:
                self._wait_for_room(need, wake)
        at = written % size
        first = size - at
        if first >= need:
            self._data[at:at + need] = data
        else:
            self._data[at:] = data[:first]
            self._data[:need - first] = data[first:]
        self._written = written = written + need
        self._room -= need
        self._run = run
        self._pos[_WRITE] = written
        if (m[_WAITING] or urgent) and not (lazy or m[_CLOSED]):  # (closed: nobody to wake)
            m[_WAITING] = 0
            wake()

    def _wait_for_room(self, need: int, wake) -> None:
        pause = _WAIT_MIN
        m = self._map
        while self.size - (self._written - self._pos[_READ]) < need:
            if m[_CLOSED]:
                raise RingClosed("the notebook no longer reads this ring")
            m[_WAITING] = 0
            wake()  # the reader may be asleep (a lost wake-up): it drains on waking
            time.sleep(pause)
            pause = min(pause * 2, _WAIT_MAX)
        self._room = self.size - (self._written - self._pos[_READ])

    @property
    def reader_gone(self) -> bool:
        """Whether the notebook closed its end (the run or session that read it is over)."""
        m = self._map
        return m is None or bool(m[_CLOSED])

    def close(self) -> None:
        with self._lock:
            if self._map is not None:
                self._data.release()
                self._pos.release()
                self._map.close()
                self._map = None


class RingReader:
    """The notebook side of one ring."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.path = path
        self.size = len(self._map) - _HEADER_SIZE
        self._data = memoryview(self._map)[_HEADER_SIZE:]
        self._pos = memoryview(self._map)[:16].cast("Q")
        self._read = self._pos[_READ]

    def read(self) -> bytes:
        """Everything appended since the last read (whole frames), and room for more."""
        m = self._map
        if m is None:
            return b""
        written = self._pos[_WRITE]
        start = self._read
        if written == start:
            return b""
        size = self.size
        at, end = start % size, written % size
        if at < end:
            data = self._data[at:end].tobytes()
        else:
            data = self._data[at:].tobytes() + self._data[:end].tobytes()
        self._read = written
        self._pos[_READ] = written
        return data

    def waiting(self, asleep: bool) -> None:
        """Whether the reader is about to sleep (then the next append wakes it)."""
        if self._map is not None:
            self._map[_WAITING] = asleep

    def close(self) -> None:
        if self._map is not None:
            self._map[_CLOSED] = 1
            self._data.release()
            self._pos.release()
            self._map.close()
            self._map = None
