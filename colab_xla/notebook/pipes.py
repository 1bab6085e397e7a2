"""What a run reads, and the reading of it: :class:`RunPipes`.

A run's replica processes send everything the notebook sees through pipes this module
makes (named pipes, opened by path in the replicas, in the directory the caller names: the
run's ``/dev/shm`` directory where there is one, else the run's directory; a session's own,
kept from cell to cell, for its cells): the frame pipe
(``channel``: events, and the frames of processes forked from a replica), a pair per
replica process for C-level output (its fd 1 and 2), and ``startup``, for what a process
prints before its rank is known. Each replica process also appends its frames to an output
ring (:mod:`colab_xla.wire.ring`) in the same directory, named by a frame on the pipe.
:class:`RunPipes` makes the pipes, reads them and the rings without waiting (the caller's
``select`` does the waiting), and hands on every frame and every C-level read to the run
that reads them now (:meth:`RunPipes.begin`); it knows nothing of what they mean.
"""

from __future__ import annotations

import itertools
import os
import select
from typing import Callable, Dict, List, Optional, Tuple

from ..wire import frames, ring

READ_SIZE = 1 << 16  # what one read of a pipe takes
PIPE_READS = frames.PIPE_SIZE // READ_SIZE  # reads that take what a full pipe holds
# While replica processes write to output rings, the reader looks at them at least this
# often: a ring's wake-up can be lost (a writer and the reader each store, then load what
# the other stored: x86 may order those loads first), and a lost one must cost a few
# milliseconds, not a tick.
RING_POLL_SECONDS = 0.005
# While output flows (the last look found some), the reader looks again this long after,
# without asking for a wake-up: a writer then pays no system call per line, and the
# reader takes more lines per look. A
# replica's end wakes it anyway: a warm session's cell waits for nothing else.
RING_FLOW_SECONDS = 0.002

# The rank of the startup pipe, and the origin of its output: replica processes' output
# before their replicas start.
STARTUP, STARTUP_LABEL = -1, "process start-up"


class RunPipes:
    """The pipes and output rings of ``processes`` replica processes in ``directory``,
    read by one run at a time (:meth:`begin` to :meth:`end`): a one-off run's, or a
    session's for cell after cell.

    While a run reads them, ``handle(frame)`` gets every frame, from the pipe or a ring, in
    the order sent; ``c_output(fd, rank, kind, data)`` every read of C-level output
    (``rank``: the local process rank, or :data:`STARTUP`; ``kind``: ``frames.STDOUT`` or
    ``frames.STDERR``), after the frames sent before it. Rings are opened only in
    ``directory``.
    """

    def __init__(self, directory: str, processes: int):
        self.directory = directory
        self._handle: Optional[Callable[[frames.Frame], None]] = None
        self._c_output: Optional[Callable[[int, int, int, bytes], None]] = None
        self.done_r: Optional[int] = None  # the run's driver thread's end (begin)
        self.done_w: Optional[int] = None
        self.channel_path = os.path.join(directory, "channel")
        self.read_fd, self.write_fd = frames.make_fifo(self.channel_path)
        self.fd_paths = tuple(tuple(os.path.join(directory, f"process-{rank}.{kind}")
                                    for kind in ("stdout", "stderr"))
                              for rank in range(processes))
        fd_pipes = [tuple(frames.make_fifo(path) for path in pair) for pair in self.fd_paths]
        # read fd -> (local process rank, stream kind)
        self.fd_sources: Dict[int, Tuple[int, int]] = {
            pipe[0]: (rank, kind)
            for rank, pair in enumerate(fd_pipes)
            for kind, pipe in zip((frames.STDOUT, frames.STDERR), pair)}
        # What a replica process prints before its rank is known (torch_xla starting its
        # runtime: XLA's fatal message for a bad XLA_FLAGS, say) goes to one more pipe.
        self.startup_path = os.path.join(directory, "startup")
        startup = frames.make_fifo(self.startup_path)
        self.fd_sources[startup[0]] = (STARTUP, frames.STDERR)
        fd_pipes.append((startup,))
        self._fds: List[int] = [self.read_fd, self.write_fd,
                                *(fd for pair in fd_pipes for pipe in pair for fd in pipe)]
        self._decoder = frames.FrameDecoder()
        # The replica processes' output rings, by path (see colab_xla.wire.ring).
        self.rings: Dict[str, Tuple[ring.RingReader, frames.FrameDecoder]] = {}
        self.ring_output = False  # a ring had output since the reading loop last looked

    def begin(self, handle: Callable[[frames.Frame], None],
              c_output: Callable[[int, int, int, bytes], None], driven: bool = True) -> None:
        """A run reads the pipes from now on (until :meth:`end`), told as the class says;
        its driver thread ends by writing to ``done_w``. (A session's reader between cells
        has no driver: not ``driven``, no ``done_w``.)"""
        self.end()
        self._handle, self._c_output = handle, c_output
        if driven:
            self.done_r, self.done_w = os.pipe()
        self.ring_output = False

    def end(self) -> None:
        """The run no longer reads: let go of its callbacks (the caller's methods, a cycle
        that would keep the caller, its outcome, the values the replicas sent and their
        shared pages until a garbage collection) and close its driver's pipe."""
        self._handle = self._c_output = None
        for fd in (self.done_r, self.done_w):
            if fd is not None:
                os.close(fd)
        self.done_r = self.done_w = None

    def read_one(self, fd: int) -> bool:
        """One read of ``fd``, its frames or C-level output handed on; False at end of file."""
        data = os.read(fd, READ_SIZE)
        if fd == self.read_fd:
            for frame in self._decoder.feed(data, merge=True):
                if frame.kind == ring.RING:
                    self._open_ring(frame.payload.decode())
                elif frame.kind == ring.WAKE:
                    pass  # the rings are read below
                else:
                    if frame.kind not in frames.STREAMS:
                        # Sent after what the rings hold (the driver's note that a process
                        # ended, say): handled after it.
                        self.read_rings()
                    self._handle(frame)
            self.read_rings()
        elif data:
            rank, kind = self.fd_sources[fd]
            self.read_pending_frames()
            self._c_output(fd, rank, kind, data)
        return bool(data)

    def read_pending_frames(self) -> None:
        """Handle the frames sent before C-level output was read: the process's start,
        which says whose output it is, and the Python lines printed before it. (While
        output flows, a ring's frames come without a wake-up, so a C-level line can wake
        the loop before them.)"""
        self.read_until_empty(self.read_fd, PIPE_READS)
        self.read_rings()

    def read_until_empty(self, fd: int, reads: Optional[int] = None) -> None:
        """Read what ``fd`` holds, without waiting for more: at most ``reads`` reads (what
        the pipe held when asked, while writers may go on), else until it is empty."""
        for _ in range(reads) if reads is not None else itertools.count():
            if not (select.select([fd], [], [], 0)[0] and self.read_one(fd)):
                return

    def read_held(self) -> None:
        """Read what every pipe and ring holds now (what was written before now: when a run
        is cut, what came later is late), without waiting for writers that go on. (One
        look at every pipe first: most hold nothing.)"""
        for fd in select.select([self.read_fd, *self.fd_sources], [], [], 0)[0]:
            self.read_until_empty(fd, PIPE_READS)
        self.read_rings()

    def read_all_after_exit(self) -> None:
        """Read everything, until every pipe is empty, once every replica process has exited:
        what they wrote is in the pipes already (and in the rings, those of processes that
        were killed too). (One look at every pipe first: most hold nothing, and one select
        finds those that do.)"""
        for fd in select.select([self.read_fd, *self.fd_sources], [], [], 0)[0]:
            self.read_until_empty(fd)
        self.read_rings()

    def _open_ring(self, path: str) -> None:
        if path not in self.rings and os.path.dirname(path) == self.directory:
            self.rings[path] = (ring.RingReader(path), frames.FrameDecoder())

    def read_rings(self) -> bool:
        """Handle what the replica processes' rings hold; whether there was anything."""
        got = False
        for reader, decoder in self.rings.values():
            data = reader.read()
            if data:
                got = self.ring_output = True
                # (decoded with merge: a replica's consecutive lines come as one frame)
                for frame in decoder.feed(data, merge=True):
                    self._handle(frame)
        return got

    def look(self, now: float, wake: float, poll: float = RING_POLL_SECONDS) -> float:
        """Read the rings before the caller waits (until ``wake`` at the latest); when to
        look at them again. While output flows, after :data:`RING_FLOW_SECONDS`, no
        wake-up asked; else a wake-up asked, and ``poll`` seconds at most (the most a lost
        wake-up costs)."""
        self.read_rings()
        if not self.ring_output:  # none since the last look (here, or by read): ask
            for reader, _ in self.rings.values():
                reader.waiting(True)  # (then read: what came before the flag is not missed)
            if self.read_rings():
                for reader, _ in self.rings.values():
                    reader.waiting(False)
        flowing, self.ring_output = self.ring_output, False
        if self.rings:
            return min(wake, now + (RING_FLOW_SECONDS if flowing else poll))
        return wake

    def close(self) -> None:
        """:meth:`end`, then close the rings (their writers see nobody reads them any more)
        and every pipe."""
        self.end()
        for reader, _ in self.rings.values():
            reader.close()
        self.rings.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
