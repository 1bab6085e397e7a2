"""Frames on a pipe from replicas to the notebook.

All replica processes of a run write to one named pipe (a FIFO in the run's private
directory, opened by path, so replicas started by spawn or a forkserver reach it too); the
notebook reads it while the run goes on. Each frame is written with one ``write(2)`` of at most
``PIPE_BUF`` bytes, which Linux keeps atomic on a pipe, so frames from different
processes and threads never interleave. Longer payloads are split into several frames;
the reader joins output per replica, so a line is never mixed with another replica's.

During a run, a replica process writes its frames to its output ring instead
(:mod:`colab_xla.wire.ring`, :meth:`ChannelWriter.use_ring`): the pipe then names the
ring and wakes the reader.

A frame is ``kind, ordinal, pid, length`` then ``length`` payload bytes. ``ordinal`` is
-1 for output that cannot be tied to one replica (a thread of a process running several
replicas that no replica started, say; a thread a replica started is that replica's).

Example::

    >>> r, w = os.pipe()
    >>> ChannelWriter(w).send(STDOUT, 3, b"hello\\n")
    >>> [(f.kind, f.ordinal, f.payload) for f in FrameDecoder().feed(os.read(r, 4096))]
    [(1, 3, b'hello\\n')]
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import threading
from typing import List, NamedTuple, Optional

from . import ring as _ring

STDOUT, STDERR, START, END, NOTE = 1, 2, 3, 4, 5
STREAMS = {STDOUT: "stdout", STDERR: "stderr"}
# RING, WAKE = 6, 7: a replica process's output ring and its wake-ups (see ring.py).
# A replica displayed a rich object: the payload names its bundle's file in the run's
# directory (colab_xla.wire.displays).
DISPLAY = 8
# An output kind | RUN opens a run of that stream's lines in a ring (see ring.py).
RUN = 0x80

_HEADER = struct.Struct("<BhiI")
# An END frame's payload starts with when the replica ended, by this host's CLOCK_MONOTONIC
# (the same clock in every process: Python's time.monotonic()); its report may follow
# (colab_xla.wire.values.end_payload).
ENDED_AT = struct.Struct("<d")
PIPE_BUF = select.PIPE_BUF
MAX_PAYLOAD = PIPE_BUF - _HEADER.size
# A roomy pipe lets replicas print bursts without waiting for the notebook to read.
PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class Frame(NamedTuple):
    kind: int
    ordinal: int
    pid: int
    payload: bytes


def make_pipe():
    """A pipe (read_fd, write_fd) enlarged where the OS allows it."""
    r, w = os.pipe()
    _enlarge(w)
    return r, w


def _enlarge(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:  # over /proc/sys/fs/pipe-max-size, or not Linux: default size
        pass


def make_fifo(path: str):
    """A named pipe at ``path``: the notebook's ``(read_fd, write_fd)``.

    The notebook keeps a write end open for the whole run, so its reads never see end of
    file while no replica has the pipe open (before they start, between processes).
    """
    os.mkfifo(path, 0o600)
    r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a blocking open would wait for a writer
    w = os.open(path, os.O_WRONLY)
    os.set_blocking(r, True)
    _enlarge(w)
    return r, w


_PID = os.getpid()  # os.getpid() is a system call: this process's, kept across forks


def _forked() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_forked)


def own_pid() -> int:
    """This process's pid, without a system call."""
    return _PID


class ChannelWriter:
    """The replica side: ``send`` never interleaves with another writer's frames.

    With :meth:`use_ring`, frames go to the process's output ring
    (:mod:`colab_xla.wire.ring`) instead of one ``write(2)`` each; a process forked from
    this one (it shares the map but not the lock) writes to the pipe.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self._ring: Optional[_ring.RingWriter] = None
        # The ring last used, kept while frames go to a pipe (a session's replica between
        # cells), for use_ring to take up again (a session's next cell).
        self._parked: Optional[_ring.RingWriter] = None
        self._switch = threading.Lock()

    def retarget(self, path: str) -> None:
        """Write to the named pipe at ``path`` from now on, on the same descriptor (a
        thread writing meanwhile writes whole frames to one pipe or the other)."""
        self.drop_ring()
        fd = os.open(path, os.O_WRONLY)
        os.dup2(fd, self.fd)
        os.close(fd)

    def use_ring(self, path: str, size: int = _ring.DEFAULT_SIZE) -> None:
        """Send frames through the ring at ``path``: the one last used if it is that one
        and still read, else a new one (named to the reader on the pipe first, either way,
        so it reads the ring before anything sent later on the pipe is handled)."""
        with self._switch:
            ring, self._parked = self._parked, None
        if ring is not None and (ring.path != path or ring.reader_gone):
            ring.close()
            ring = None
        if ring is None:
            ring = _ring.RingWriter(path, size)
        self._write_frames(_ring.RING, -1, path.encode())
        with self._switch:
            old, self._ring = self._ring, ring
        if old is not None and old is not ring:
            old.close()

    def drop_ring(self) -> None:
        """Send frames to the pipe from now on; the ring is kept for :meth:`use_ring`."""
        with self._switch:
            old, self._ring = self._ring, None
            if old is None:
                return
            stale, self._parked = self._parked, old
        if stale is not None:
            stale.close()

    def send(self, kind: int, ordinal: int, payload: bytes) -> None:
        ring = self._ring
        if ring is not None and ring.pid == _PID:
            try:
                if len(payload) <= MAX_PAYLOAD:
                    if kind in STREAMS and _ring.RUN_END not in payload:
                        ring.append_run((kind, ordinal), payload, _run_opening, self._wake)
                    else:
                        # A replica's end always wakes the reader; its start never does:
                        # nobody waits for it, and it comes with what the replica sends
                        # next (a warm session's cell of 8 replicas woke the notebook 16
                        # times, 8 of them for starts). See RingWriter.append.
                        ring.append(_HEADER.pack(kind, ordinal, _PID, len(payload)) + payload,
                                    self._wake, urgent=kind == END, lazy=kind == START)
                else:  # (a long line: a ring's room at most at a time)
                    parts = self._frames(kind, ordinal, payload)
                    step = 2 * max(1, ring.size // (4 * PIPE_BUF))
                    for start in range(0, len(parts), step):
                        ring.append(b"".join(parts[start:start + step]), self._wake)
                return
            except _ring.RingClosed:
                if self._ring is ring:  # the reader is gone: the pipe says so (EPIPE)
                    raise
                # switched meanwhile (a new run): the frames go where the writer points now
        self._write_frames(kind, ordinal, payload)

    def _wake(self) -> None:
        os.write(self.fd, _HEADER.pack(_ring.WAKE, -1, _PID, 0))

    @staticmethod
    def _frames(kind: int, ordinal: int, payload: bytes) -> list:
        """``payload`` as frames of at most MAX_PAYLOAD bytes: header, chunk, header, ...
        (one empty frame for an empty payload)."""
        pack = _HEADER.pack
        view = memoryview(payload)
        parts = []
        for start in range(0, max(len(view), 1), MAX_PAYLOAD):
            chunk = view[start:start + MAX_PAYLOAD]
            parts += (pack(kind, ordinal, _PID, len(chunk)), chunk)
        return parts

    def _write_frames(self, kind: int, ordinal: int, payload: bytes) -> None:
        parts = self._frames(kind, ordinal, payload)
        for i in range(0, len(parts), 2):
            # A blocking write of <= PIPE_BUF bytes is all-or-nothing: no partial frames.
            os.write(self.fd, parts[i] + parts[i + 1])


def _run_opening(key) -> bytes:
    """The header that opens a run of ``key`` = (output kind, ordinal) in a ring."""
    return _HEADER.pack(key[0] | RUN, key[1], _PID, 0)


class FrameDecoder:
    """The notebook side: turns bytes read from the pipe into :class:`Frame` objects."""

    def __init__(self):
        self._buf = bytearray()
        self._run: Optional[tuple] = None  # (kind, ordinal, pid) of the run being read

    def feed(self, data: bytes, merge: bool = False) -> List[Frame]:
        """The whole frames ``data`` completes. With ``merge``, consecutive output frames
        of one replica, stream and process come as one frame (their payloads joined): a
        chatty replica sends a frame per line, and per-frame work would cap throughput.
        What a ring's run holds comes as one frame in any case."""
        buf = self._buf
        buf += data
        frames, pos, end_of_data = [], 0, len(buf)
        size, unpack = _HEADER.size, _HEADER.unpack_from
        view = memoryview(buf)
        key, parts = None, []  # the output being merged: its (kind, ordinal, pid), chunks

        def flush() -> None:
            nonlocal key, parts
            if parts:
                frames.append(Frame(*key, b"".join(parts)))
            key, parts = None, []

        def output(of, chunk) -> None:
            nonlocal key
            if key != of:
                flush()
                key = of
            parts.append(chunk)
            if not merge:
                flush()

        try:
            while True:
                if self._run is not None:  # the lines of a run, up to its end
                    stop = buf.find(_ring.RUN_END, pos)
                    end = end_of_data if stop < 0 else stop
                    if end > pos:
                        output(self._run, view[pos:end])
                    if stop < 0:
                        pos = end_of_data
                        break
                    self._run, pos = None, stop + 1
                if end_of_data - pos < size:
                    break
                kind, ordinal, pid, length = unpack(buf, pos)
                end = pos + size + length
                if end > end_of_data:
                    break
                if kind & RUN:
                    self._run = (kind & ~RUN, ordinal, pid)
                elif kind in STREAMS:
                    output((kind, ordinal, pid), view[pos + size:end])
                else:
                    flush()
                    frames.append(Frame(kind, ordinal, pid, view[pos + size:end].tobytes()))
                pos = end
            flush()
        finally:
            parts = []  # (its chunks are views of buf: released before buf is resized)
            view.release()  # a bytearray with a live view cannot be resized
        del buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still waiting for the rest."""
        return len(self._buf)
