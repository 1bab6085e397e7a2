"""Frames on a pipe from replicas to the notebook.

All replica processes of a run write to one named pipe (a FIFO in the run's private
directory, opened by path, so replicas started by spawn or a forkserver reach it too); the
notebook reads it while the run goes on. Each frame is written with one ``write(2)`` of at most
``PIPE_BUF`` bytes, which Linux keeps atomic on a pipe, so frames from different
processes and threads never interleave. Longer payloads are split into several frames;
the reader joins output per replica, so a line is never mixed with another replica's.

A frame is ``kind, ordinal, pid, length`` then ``length`` payload bytes. ``ordinal`` is
-1 for output that cannot be tied to one replica (a thread the cell started, say).

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
from typing import List, NamedTuple

STDOUT, STDERR, START, END, NOTE = 1, 2, 3, 4, 5
STREAMS = {STDOUT: "stdout", STDERR: "stderr"}

_HEADER = struct.Struct("<BhiI")
PIPE_BUF = select.PIPE_BUF
MAX_PAYLOAD = PIPE_BUF - _HEADER.size
# A roomy pipe lets replicas print bursts without waiting for the notebook to read.
_PIPE_SIZE = 1 << 20
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
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_SIZE)
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


class ChannelWriter:
    """The replica side: ``send`` never interleaves with another writer's frames."""

    def __init__(self, fd: int):
        self.fd = fd

    def retarget(self, path: str) -> None:
        """Write to the named pipe at ``path`` from now on, on the same descriptor (a
        thread writing meanwhile writes whole frames to one pipe or the other)."""
        fd = os.open(path, os.O_WRONLY)
        os.dup2(fd, self.fd)
        os.close(fd)

    def send(self, kind: int, ordinal: int, payload: bytes) -> None:
        pid = os.getpid()
        view = memoryview(payload)
        for start in range(0, max(len(view), 1), MAX_PAYLOAD):
            chunk = view[start:start + MAX_PAYLOAD]
            # A blocking write of <= PIPE_BUF bytes is all-or-nothing: no partial frames.
            os.write(self.fd, _HEADER.pack(kind, ordinal, pid, len(chunk)) + chunk)


class FrameDecoder:
    """The notebook side: turns bytes read from the pipe into :class:`Frame` objects."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> List[Frame]:
        buf = self._buf
        buf += data
        frames, pos, end_of_data = [], 0, len(buf)
        size, unpack = _HEADER.size, _HEADER.unpack_from
        view = memoryview(buf)
        try:
            while end_of_data - pos >= size:
                kind, ordinal, pid, length = unpack(buf, pos)
                end = pos + size + length
                if end > end_of_data:
                    break
                frames.append(Frame(kind, ordinal, pid, view[pos + size:end].tobytes()))
                pos = end
        finally:
            view.release()  # a bytearray with a live view cannot be resized
        del buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still waiting for the rest."""
        return len(self._buf)
