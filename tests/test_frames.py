"""The channel's frames (colab_xla.wire.frames): round trips, long payloads, writers at once."""

import multiprocessing
import os
import select
import threading

import pytest

from colab_xla.wire import frames

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_frames_round_trip_even_when_fed_byte_by_byte():
    r, w = os.pipe()
    writer = frames.ChannelWriter(w)
    writer.send(frames.STDOUT, 2, "héllo\n".encode())
    writer.send(frames.END, 5, b"")
    data = os.read(r, 65536)
    decoder = frames.FrameDecoder()
    received = [f for byte in data for f in decoder.feed(bytes([byte]))]
    assert [(f.kind, f.ordinal, f.payload) for f in received] == [
        (frames.STDOUT, 2, "héllo\n".encode()), (frames.END, 5, b"")]
    assert received[0].pid == os.getpid() and decoder.pending == 0
    os.close(r), os.close(w)


def test_long_payload_is_split_into_atomic_frames():
    r, w = frames.make_pipe()
    payload = bytes(range(256)) * 100  # 25,600 bytes
    frames.ChannelWriter(w).send(frames.STDERR, 0, payload)
    os.close(w)
    data = b"".join(iter(lambda: os.read(r, 65536), b""))
    received = frames.FrameDecoder().feed(data)
    assert len(received) == -(-len(payload) // frames.MAX_PAYLOAD)
    assert b"".join(f.payload for f in received) == payload
    os.close(r)


def _hammer(fd, ordinal, count):
    writer = frames.ChannelWriter(fd)
    for i in range(count):
        writer.send(frames.STDOUT, ordinal, f"{ordinal}:{i}:".encode() + b"x" * (i % 3000) + b"\n")


def test_concurrent_writers_never_interleave_frames():
    """Processes and threads writing at once: every frame intact, each writer in order."""
    r, w = frames.make_pipe()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(w, o, 400)) for o in range(3)]
    threads = [threading.Thread(target=_hammer, args=(w, o, 400)) for o in range(3, 5)]
    for t in procs + threads:
        t.start()
    decoder, received = frames.FrameDecoder(), []
    expected = 5 * 400
    while len(received) < expected:  # a lost frame: stop once the writers ended, not hang
        ended = not any(t.is_alive() for t in procs + threads)  # before looking at the pipe
        if select.select([r], [], [], 0.1)[0]:
            received += decoder.feed(os.read(r, 65536))
        elif ended:  # everything the writers sent was in the pipe, and it is empty
            break
    for t in procs + threads:
        t.join()
    got = {o: set() for o in range(5)}
    for f in received:
        got.setdefault(f.ordinal, set()).add(int(f.payload.split(b":", 2)[1]))
    missing = {o: sorted(set(range(400)) - seen)[:5] for o, seen in got.items() if len(seen) < 400}
    assert len(received) == expected, (
        f"the writers ended and {len(received)} of {expected} frames arrived (missing, per "
        f"writer: {missing}; {decoder.pending} bytes of an unfinished frame)")
    assert [p.exitcode for p in procs] == [0, 0, 0]
    seen = {}
    for f in received:
        o, i, rest = f.payload.split(b":", 2)
        assert int(o) == f.ordinal and rest == b"x" * (int(i) % 3000) + b"\n"
        assert int(i) == seen.get(f.ordinal, -1) + 1  # in order per writer
        seen[f.ordinal] = int(i)
    assert seen == {o: 399 for o in range(5)}
    os.close(r), os.close(w)
