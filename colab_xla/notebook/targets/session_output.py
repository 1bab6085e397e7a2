"""What a session's replicas send outside any cell, read all the time:
:class:`SessionChannel`; and the pipes it reads, which a session keeps from its start to its
end and lends to one cell at a time: :class:`SessionPipes`.

A session's replica processes write to one set of pipes and output rings for as long as
the session lives (a :class:`~colab_xla.notebook.pipes.RunPipes`, made as it starts): as
they start, during every cell, and between cells. A replica process opens them once, so
a cell costs it no ``open`` of a named pipe and no new ring (as switching between pipes of
its own and each cell's would). A cell's :class:`~colab_xla.notebook.supervisor.Supervisor`
reads them while the cell runs (:meth:`SessionChannel.lend`); the rest of the time a
thread reads them, so a replica that prints between cells (a thread of its own, a
library's warning) never blocks on a full pipe or ring; its notes go to whoever waits for
them (:meth:`SessionChannel.notes`), and the last lines are kept
(:meth:`SessionChannel.printed`): what a replica said before it died, for the message that
it died and for ``%xla_session``'s status.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import json
import os
import select
import shutil
import threading
import time
from typing import Callable, Deque, Dict, List, Optional

from ...wire import frames, shared_tensors
from ..pipes import STARTUP, RunPipes

# The lines kept of what the replicas printed outside any cell.
KEPT_LINES = 40
# How long the reader waits in one select at most, between cells: also the most a lost
# wake-up of a ring costs then (a cell's reader looks every RING_POLL_SECONDS; an idle
# session looks less often, to take little of the notebook's CPU).
_IDLE_SECONDS = 0.1
# The reader's commands, a byte each on its control pipe.
_LEND, _CLOSE, _READ = b"l", b"c", b"r"


class SessionChannel:
    """The session's ``pipes``, read by a thread of this object's whenever no cell reads
    them (:meth:`lend`, :meth:`give_back`), until :meth:`close`. The pipes stay the
    session's: closing this does not close them."""

    def __init__(self, pipes: RunPipes):
        self.pipes = pipes
        self._text: Dict[object, codecs.IncrementalDecoder] = {}  # by origin
        self._partial: Dict[object, str] = {}  # an unended line, by origin
        self._lines: Deque[str] = collections.deque(maxlen=KEPT_LINES)
        self._notes: List[dict] = []
        self._changed = threading.Condition()
        # Held by whoever reads the pipes at the moment (the reader thread, or lend): a
        # cell takes them without waiting for the reader thread to wake and let go (a round
        # trip between threads on busy cores).
        self._reading = threading.Lock()
        self._lent = False  # a cell reads the pipes (changed holding _reading)
        # The reader thread's select takes in the pipes (set by it, holding _reading): lend
        # wakes it only then.
        self._watching = False
        self._lends = 0  # how many times a cell took them
        self._closed = False
        # printed()'s passes over the pipes: asked of the reader, and done by it
        self._reads_asked = self._reads_done = 0
        self._control_r, self._control_w = os.pipe()
        pipes.begin(self._frame, self._c_output, driven=False)
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
        the pipes hold now is read first (a pass of the reader's, waited for up to
        ``settle`` seconds; none while a cell holds them)."""
        deadline = time.monotonic() + settle
        with self._changed:
            if not (self._lent or self._closed) and self._thread.is_alive():
                self._reads_asked += 1
                asked = self._reads_asked
                os.write(self._control_w, _READ)
                while self._reads_done < asked and self._thread.is_alive():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
            return list(self._lines) + [f"{_label(origin)}{text}"
                                        for origin, text in self._partial.items() if text]

    def lend(self) -> RunPipes:
        """Stop reading the pipes, once what they hold now is read (as the session's, not
        the cell's): a cell reads them until :meth:`give_back`."""
        with self._reading:
            if not self._lent and not self._closed and self._thread.is_alive():
                self.pipes.read_held()
                self.pipes.end()
                if self._watching:  # (the reader: no more select on them)
                    os.write(self._control_w, _LEND)
                    self._watching = False
            self._lent = True
            self._lends += 1
        return self.pipes

    def give_back(self) -> None:
        """The cell is done with the pipes: the reader reads them again from its next look,
        within :data:`_IDLE_SECONDS`, unwoken (cells one after another then wake it
        neither here nor at :meth:`lend`, and a warm cell pays for no wake-up)."""
        with self._reading:
            if not self._lent:
                return
            self._lent = False
            if not self._closed and self._thread.is_alive():
                self.pipes.begin(self._frame, self._c_output, driven=False)

    def close(self) -> None:
        """Stop reading (what is left unread is dropped); the pipes stay open. Again:
        nothing."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
        os.write(self._control_w, _CLOSE)
        self._thread.join(2.0)
        for fd in (self._control_r, self._control_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read(self) -> None:
        pipes = self.pipes
        while True:
            with self._reading:
                reading, lends = not self._lent, self._lends
                self._watching = reading
                now = time.monotonic()
                wake = (pipes.look(now, now + _IDLE_SECONDS, poll=_IDLE_SECONDS) if reading
                        else now + _IDLE_SECONDS)  # (given back unwoken: see give_back)
            fds = ([pipes.read_fd, *pipes.fd_sources] if reading else []) + [self._control_r]
            try:
                readable, _, _ = select.select(fds, [], [], max(0.0, wake - now))
            except (OSError, ValueError):  # closed under it
                return
            if self._control_r in readable:
                command = os.read(self._control_r, 1)
                if command == _CLOSE or not command:
                    return
                if command == _READ:  # printed(): what was written before now, handled
                    try:
                        with self._reading:
                            if not self._lent:
                                pipes.read_held()
                    except OSError:  # closed under it: the session is ending
                        return
                    finally:
                        with self._changed:
                            self._reads_done += 1
                            self._changed.notify_all()
                continue  # (_LEND: look again at who reads the pipes)
            with self._reading:
                # A cell took them since the select (and may have read them and given them
                # back): what it saw readable may be empty now, and a read would block.
                if self._lent or self._lends != lends:
                    continue
                for fd in readable:
                    try:
                        pipes.read_one(fd)
                    except OSError:  # closed under it: the session is ending
                        return

    def _frame(self, frame: frames.Frame) -> None:
        with self._changed:
            if frame.kind == frames.NOTE:
                self._notes.append({**json.loads(frame.payload), "ordinal": frame.ordinal})
                self._changed.notify_all()
            elif frame.kind in frames.STREAMS:
                self._keep(frame.ordinal if frame.ordinal >= 0 else None, frame.payload)
            # (the START and END of a cell cut before they came: that cell is over)

    def _c_output(self, fd: int, rank: int, kind: int, data: bytes) -> None:
        with self._changed:
            self._keep(None if rank == STARTUP else f"process {rank}", data)

    def _keep(self, origin, data: bytes) -> None:
        decoder = self._text.get(origin)
        if decoder is None:
            decoder = self._text[origin] = codecs.getincrementaldecoder("utf-8")("replace")
        *ended, rest = (self._partial.get(origin, "") + decoder.decode(data)).split("\n")
        self._lines.extend(_label(origin) + line for line in ended)
        self._partial[origin] = rest


def _label(origin) -> str:
    if origin is None:
        return ""
    return f"[replica {origin}] " if isinstance(origin, int) else f"[{origin}] "


class SessionPipes:
    """The pipes and output rings a session's replicas write to, from their start to their
    end (:meth:`open`), with their reader between cells (a :class:`SessionChannel`), lent to
    one cell at a time (:meth:`lend` to :meth:`give_back`) and closed as the session ends
    (:meth:`close`). ``directory``: the session's (where they go without shared memory);
    ``lock``: the session's, held where a cell's thread and the session's end meet;
    ``ended()``: whether the session has ended."""

    def __init__(self, directory: str, processes: int, lock, ended: Callable[[], bool]):
        self._directory, self._processes = directory, processes
        self._lock, self._ended = lock, ended
        self._pipes: Optional[RunPipes] = None
        self._channel: Optional[SessionChannel] = None
        # A cell holds the pipes (lend to give_back). Not the channel's own "lent"
        # (SessionChannel._lent, its reader let go of them): a cell also holds the pipes of
        # a session that ended, which have no channel (see lend), and close must then leave
        # their closing to the cell.
        self._lent = False

    @property
    def directory(self) -> Optional[str]:
        """Where the pipes are (None once closed)."""
        return None if self._pipes is None else self._pipes.directory

    def open(self) -> RunPipes:
        """Make the pipes (in shared memory where there is some) and start their reader."""
        self._pipes = RunPipes(self._pipes_dir(), self._processes)
        self._channel = SessionChannel(self._pipes)
        return self._pipes

    def notes(self, wait: float) -> List[dict]:
        """The replicas' notes outside a cell (:meth:`SessionChannel.notes`)."""
        return self._channel.notes(wait)

    def printed(self) -> List[str]:
        """The last lines the replicas printed outside a cell (none before :meth:`open`)."""
        return self._channel.printed() if self._channel is not None else []

    def lend(self) -> RunPipes:
        """The pipes, lent to one cell until :meth:`give_back` (between cells, the channel
        reads them). Made once, as the session starts (in shared memory where there is
        some): the replica processes open them and make their rings once, and each cell
        costs no named pipes, no ring and no directory for them (made and removed for every
        cell, they would be much of a warm cell's time)."""
        with self._lock:
            self._lent = True
            if self._pipes is None:  # ended, and closed: the cell is refused as it starts
                self._pipes = RunPipes(self._pipes_dir(), self._processes)
                return self._pipes
        return self._channel.lend()

    def give_back(self) -> None:
        """The cell that :meth:`lend` lent them to has read them for the last time; closed
        if the session has ended meanwhile."""
        with self._lock:
            self._lent = False
            if self._pipes is None:
                return
            if not self._ended():
                self._channel.give_back()
                return
        self._close_pipes()

    def close(self) -> None:
        """The session has ended: stop the reader, and close the pipes unless a cell holds
        them (then :meth:`give_back` closes them)."""
        if self._channel is not None:
            self._channel.close()
        with self._lock:
            lent = self._lent
        if not lent:
            self._close_pipes()

    def _pipes_dir(self) -> str:
        """A directory for the session's pipes and its cells' files: in shared memory where
        there is some."""
        try:
            return shared_tensors.make_private_dir("session")
        except OSError:  # no /dev/shm: the session's directory
            os.makedirs(self._directory, exist_ok=True)
            return self._directory

    def _close_pipes(self) -> None:
        if self._channel is not None:  # (its reader first: it must not read closed fds)
            self._channel.close()
        with self._lock:
            pipes, self._pipes = self._pipes, None
        if pipes is not None:
            pipes.close()
            if pipes.directory != self._directory:
                shutil.rmtree(pipes.directory, ignore_errors=True)
