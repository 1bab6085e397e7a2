"""Output through a replica process's shared-memory ring (colab_xla.wire.ring): nothing
lost when the ring wraps under a slow reader, when the writer is killed right after it
printed, or when a process forked from a replica writes."""

import os
import select
import signal
import threading
import time

import pytest

from _runs import run  # tests/ is on sys.path
from colab_xla.notebook.outcome import RunObserver
from colab_xla.wire import frames, ring


pytestmark = [pytest.mark.stacks("colab", "kaggle")]


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


def _mixed_sends(writer):
    """Runs of lines broken by every other kind of frame: another stream, another
    replica, a note, a line that is not UTF-8 (0xFE in it), an empty line, a long one."""
    sent = []

    def send(kind, ordinal, payload):
        writer.send(kind, ordinal, payload)
        sent.append((kind, ordinal, payload))

    for i in range(50):
        send(frames.STDOUT, 0, f"out {i}\n".encode())
    send(frames.STDERR, 0, "érr\n".encode())
    send(frames.STDOUT, 0, b"after the error\n")
    send(frames.STDOUT, 1, b"another replica\n")
    send(frames.NOTE, 1, b"a note")
    send(frames.STDOUT, 1, b"not utf-8 \xfe\xff\n")
    send(frames.STDOUT, 1, b"")
    send(frames.STDOUT, 1, b"y" * (3 * frames.MAX_PAYLOAD) + b"\n")
    for i in range(20):
        send(frames.STDOUT, 1, f"more {i}\n".encode())
    return sent


def _joined(received):
    """Consecutive payloads of one (kind, ordinal) joined: what a view shows."""
    out = []
    for kind, ordinal, payload in received:
        if out and out[-1][:2] == (kind, ordinal) and kind in frames.STREAMS:
            out[-1] = (kind, ordinal, out[-1][2] + payload)
        else:
            out.append((kind, ordinal, payload))
    return [item for item in out if item[2] or item[0] not in frames.STREAMS]


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_runs_and_frames_decode_in_order_however_the_bytes_are_cut(channel, chunk):
    channel.use()
    reader = channel.reader()
    sent = _mixed_sends(channel.writer)
    data = reader.read()
    decoder = frames.FrameDecoder()
    received = [(f.kind, f.ordinal, f.payload) for start in range(0, len(data), chunk)
                for f in decoder.feed(data[start:start + chunk], merge=chunk > 1)]
    assert _joined(received) == _joined(sent)
    assert all(f[0] in frames.STREAMS or f[0] == frames.NOTE for f in received)
    assert decoder.pending == 0


def test_a_print_loop_is_one_run_in_the_ring_one_header_for_all_its_lines(channel):
    channel.use()
    reader = channel.reader()
    lines = [f"line {i}\n".encode() for i in range(1000)]
    for line in lines:
        channel.writer.send(frames.STDOUT, 0, line)
    data = reader.read()
    header = frames._HEADER.size
    assert len(data) == header + sum(map(len, lines))  # the lines' bytes, one header
    (frame,) = frames.FrameDecoder().feed(data)  # all of them as one frame, even unmerged
    assert (frame.kind, frame.ordinal, frame.payload) == (frames.STDOUT, 0, b"".join(lines))
    channel.writer.send(frames.END, 0, b"")  # ends the run: the next line opens another
    channel.writer.send(frames.STDOUT, 0, b"last\n")
    # RUN_END, END's header, the new run's header, its line
    assert len(reader.read()) == 1 + header + header + len(b"last\n")


def _pipe_kinds(pipe_r):
    """The kinds of the frames the pipe holds now."""
    data = b""
    while select.select([pipe_r], [], [], 0)[0]:
        data += os.read(pipe_r, 1 << 16)
    return [f.kind for f in frames.FrameDecoder().feed(data)]


def test_a_replica_s_end_wakes_the_reader_even_while_it_does_not_ask(channel):
    """While output flows, the notebook looks at the rings every few ms without asking for
    wake-ups; a replica's end is what a session's cell waits for, so it wakes the reader
    anyway (else it waited up to RING_FLOW_SECONDS), unless the reader has closed the ring."""
    channel.use()
    reader = channel.reader()
    assert _pipe_kinds(channel.pipe_r) == [ring.RING]
    channel.writer.send(frames.START, 0, b"{}")
    channel.writer.send(frames.STDOUT, 0, b"a line\n")
    assert _pipe_kinds(channel.pipe_r) == []  # not asked: no wake-up
    channel.writer.send(frames.END, 0, frames.ENDED_AT.pack(1.0))
    assert _pipe_kinds(channel.pipe_r) == [ring.WAKE]
    reader.waiting(True)  # asked, then the end: one wake-up still
    channel.writer.send(frames.END, 1, frames.ENDED_AT.pack(2.0))
    assert _pipe_kinds(channel.pipe_r) == [ring.WAKE]
    got = frames.FrameDecoder().feed(reader.read(), merge=True)
    assert [(f.kind, f.ordinal) for f in got] == [
        (frames.START, 0), (frames.STDOUT, 0), (frames.END, 0), (frames.END, 1)]
    reader.close()  # the run is over: an end that comes late wakes nobody
    channel.writer.send(frames.END, 2, frames.ENDED_AT.pack(3.0))
    assert _pipe_kinds(channel.pipe_r) == []


def test_a_replica_s_start_never_wakes_the_reader_the_next_frame_that_does_brings_it(channel):
    """Nobody waits for a replica's start: it does not wake the reader even while the reader
    asks (a warm session's cell of 8 replicas woke the notebook 16 times, 8 for starts), and
    the reader's request stays for the frame after it, which brings both."""
    channel.use()
    reader = channel.reader()
    assert _pipe_kinds(channel.pipe_r) == [ring.RING]
    reader.waiting(True)
    channel.writer.send(frames.START, 0, b"{}")
    assert _pipe_kinds(channel.pipe_r) == []  # asked, but a start: no wake-up
    channel.writer.send(frames.STDOUT, 0, b"a line\n")
    assert _pipe_kinds(channel.pipe_r) == [ring.WAKE]  # the request was still there
    got = frames.FrameDecoder().feed(reader.read(), merge=True)
    assert [(f.kind, f.ordinal) for f in got] == [(frames.START, 0), (frames.STDOUT, 0)]


def test_a_ring_without_room_for_its_pages_is_not_made_and_frames_go_to_the_pipe(channel,
                                                                                monkeypatch):
    """On a full file system the ring's pages are refused at once (ENOSPC), not later as a
    SIGBUS at the print that touches one: the file is gone and the pipe carries the line."""
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError):
        channel.use()
    assert not os.path.exists(channel.path)
    channel.writer.send(frames.STDOUT, 0, b"still here\n")
    piped = frames.FrameDecoder().feed(os.read(channel.pipe_r, 1 << 16))
    assert [(f.kind, f.payload) for f in piped] == [(frames.STDOUT, b"still here\n")]


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
    expected = "".join(f"line {i}\n" for i in range(5000)) + "a partial line"
    assert b"".join(payloads).decode() == expected


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
    assert [(f.ordinal, f.pid, f.payload) for f in ringed] == [
        (0, os.getpid(), b"from the parent\n")]


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


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_replica_printing_fast_sends_almost_no_wake_ups():
    """While output flows the notebook looks at the ring without asking for wake-ups: a
    print loop pays no write(2) per line (it paid one every ~3 lines when each look asked)."""
    outcome = run("""
        from colab_xla.wire import frames
        wakes = []
        send_wake = frames.ChannelWriter._wake
        frames.ChannelWriter._wake = lambda self: wakes.append(1) or send_wake(self)
        for i in range(50000):
            print(f"r{index} line {i}")
        len(wakes)
        """, 1)
    assert outcome.replicas[0].state == "done", outcome.replicas[0].error
    assert outcome.replicas[0].value < 500  # under 1% of the lines


class _Draws(RunObserver):
    def __init__(self):
        self.ticks = 0

    def tick(self, outcome):
        self.ticks += 1


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_while_output_flows_the_views_draw_a_few_times_a_second_not_per_line():
    draws = _Draws()
    outcome = run("""
        import time
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            print("x" * 20)
            time.sleep(0.001)
        """, 1, observer=draws)
    assert outcome.replicas[0].state == "done", outcome.replicas[0].error
    # at once, then after 10, 20, 40, 80, 160 ms, then every 250 ms: about 11 in 1.5 s
    # (a draw per look at the rings would be hundreds)
    assert 4 <= draws.ticks <= 25, draws.ticks


def test_a_writer_takes_up_the_ring_it_left_for_the_pipe_while_its_reader_reads_it(tmp_path):
    """A session's replica process makes its ring once: between cells its frames go to
    the session's pipe, and the next cell's use_ring takes the same ring up again."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    writer = frames.ChannelWriter(w)
    path = str(tmp_path / "ring-1")
    writer.use_ring(path, size=1 << 16)
    reader = ring.RingReader(path)
    decoder = frames.FrameDecoder()
    kept = writer._ring
    writer.send(frames.STDOUT, 0, b"cell 1\n")
    writer.drop_ring()  # between cells: to the pipe
    writer.send(frames.STDOUT, 0, b"between\n")
    assert os.read(r, 1 << 16).endswith(b"between\n")
    writer.use_ring(path, size=1 << 16)  # the next cell: the same ring, no new file
    assert writer._ring is kept
    writer.send(frames.STDOUT, 0, b"cell 2\n")
    assert b"".join(f.payload for f in decoder.feed(reader.read())) == b"cell 1\ncell 2\n"
    assert os.read(r, 1 << 16) == frames._HEADER.pack(ring.RING, -1, os.getpid(),
                                                       len(path)) + path.encode()
    # Another ring, or one its reader closed (the session ended): never taken up again.
    other = str(tmp_path / "ring-2")
    writer.drop_ring()
    writer.use_ring(other, size=1 << 16)
    assert writer._ring is not kept and kept.reader_gone  # (closed here: unmapped)
    reader.close()
    writer.drop_ring()
    taken = writer._parked
    ring.RingReader(other).close()
    with pytest.raises(FileExistsError):  # not taken up: a new one is made (and cannot be)
        writer.use_ring(other, size=1 << 16)
    assert taken.reader_gone and writer._ring is None
    writer.drop_ring()
    os.close(r)
    os.close(w)
