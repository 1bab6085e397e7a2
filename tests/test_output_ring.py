"""Output through a replica process's shared-memory ring (colab_xla.transport.ring): nothing
lost when the ring wraps under a slow reader, when the writer is killed right after it
printed, or when a process forked from a replica writes."""

import os
import select
import signal
import threading
import time

import pytest

from _runs import run  # tests/ is on sys.path
from colab_xla.transport import frames, ring


class Channel:
    """A replica's frame pipe and output ring, as a test holds them: the pipe's ends, the
    ring's path, the writer (with ``use(size)`` its ring is made) and the readers opened
    (``reader()``); everything is closed when the test ends, whatever happened."""

    def __init__(self, tmp_path):
        self.pipe_r, self.pipe_w = os.pipe()
        self.path = str(tmp_path / "ring")
        self.writer = frames.ChannelWriter(self.pipe_w)
        self._readers = []

    def use(self, size: int = ring.DEFAULT_SIZE) -> None:
        self.writer.use_ring(self.path, size)

    def reader(self) -> ring.RingReader:
        self._readers.append(ring.RingReader(self.path))
        return self._readers[-1]

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
        self.writer.drop_ring()
        for fd in (self.pipe_r, self.pipe_w):
            os.close(fd)


@pytest.fixture
def channel(tmp_path):
    made = Channel(tmp_path)
    yield made
    made.close()


def _read_all(reader, pipe_r, wanted: int, seconds: float = 120):
    """Read the ring as the notebook does: sleep on the pipe (wake-ups) when it is empty;
    the lines read, and the kinds of frame the pipe carried."""
    decoder, pipe, text, kinds = frames.FrameDecoder(), frames.FrameDecoder(), b"", set()
    deadline = time.monotonic() + seconds
    while (read := text.count(b"\n")) < wanted:
        assert time.monotonic() < deadline, f"{read} of {wanted} lines read"
        reader.waiting(True)
        data = reader.read()  # (after the flag: what came before it is not missed)
        if data:
            reader.waiting(False)
            text += b"".join(f.payload for f in decoder.feed(data, merge=True))
        elif select.select([pipe_r], [], [], 5)[0]:
            kinds |= {f.kind for f in pipe.feed(os.read(pipe_r, 1 << 16))}
    return text.decode().splitlines(), kinds


def test_a_ring_that_wraps_while_the_reader_is_slow_loses_nothing(channel):
    channel.use(size=256)  # a few frames: it wraps every few lines
    named = frames.FrameDecoder().feed(os.read(channel.pipe_r, 1 << 16))
    assert [(f.kind, f.payload) for f in named] == [(ring.RING, channel.path.encode())]
    reader = channel.reader()
    n = 3000

    def write():
        for i in range(n):
            channel.writer.send(frames.STDOUT, 0, f"line {i} {'x' * (i % 50)}\n".encode())

    thread = threading.Thread(target=write)
    thread.start()
    try:
        lines, kinds = _read_all(reader, channel.pipe_r, n)
    finally:
        thread.join()
    assert lines == [f"line {i} {'x' * (i % 50)}" for i in range(n)]
    assert kinds <= {ring.WAKE}  # the pipe carried wake-ups only


def test_a_writer_waiting_for_room_stops_when_the_reader_has_closed_the_ring(channel):
    channel.use(size=64)
    channel.reader().close()
    with pytest.raises(BrokenPipeError):
        for _ in range(10):
            channel.writer.send(frames.STDOUT, 0, b"a line that fills a tiny ring\n")


def test_lines_appended_before_a_sigkill_are_all_read(channel):
    pid = os.fork()
    if pid == 0:  # the replica: print, and die at once
        try:
            channel.use()
            for i in range(5000):
                channel.writer.send(frames.STDOUT, 0, f"line {i}\n".encode())
            channel.writer.send(frames.STDOUT, 0, b"a partial line")
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    payloads = [f.payload for f in frames.FrameDecoder().feed(channel.reader().read())]
    assert b"".join(payloads).decode() == "".join(f"line {i}\n" for i in range(5000)) + "a partial line"


def test_a_process_forked_from_a_ring_writer_writes_to_the_pipe(channel):
    channel.use()
    os.read(channel.pipe_r, 1 << 16)  # the ring's name
    reader = channel.reader()
    pid = os.fork()
    if pid == 0:
        try:
            channel.writer.send(frames.STDOUT, 1, b"from the child\n")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    channel.writer.send(frames.STDOUT, 0, b"from the parent\n")
    piped = frames.FrameDecoder().feed(os.read(channel.pipe_r, 1 << 16))
    assert [(f.ordinal, f.pid, f.payload) for f in piped] == [(1, pid, b"from the child\n")]
    ringed = frames.FrameDecoder().feed(reader.read())
    assert [(f.ordinal, f.pid, f.payload) for f in ringed] == [(0, os.getpid(), b"from the parent\n")]


@pytest.mark.xla
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["os.kill(os.getpid(), signal.SIGKILL)", "os._exit(7)"])
def test_a_replica_that_dies_right_after_printing_loses_no_line(how):
    outcome = run(f"""
        import os, signal, sys
        for i in range(20000):
            print(f"r{{index}} line {{i}}")
        sys.stdout.write("progress 50%\\r")
        sys.stdout.flush()
        if index == 1:
            {how}
        """, 2)
    assert outcome.replicas[1].state == "failed"
    with open(outcome.replicas[1].log.path, encoding="utf-8") as f:
        text = f.read()
    # (replica 0 may be stopped by the run's fail-fast, or die with it if they share a process)
    assert text.startswith("".join(f"r1 line {i}\n" for i in range(20000)))
    assert "progress 50%" in text[-40:]
