"""Units of what the run loop is made of, each alone: when a run is cut
(colab_xla.notebook.deadlines), the pieces of C-level lines held back
(colab_xla.notebook.partial_lines) and the reading of a run's pipes and rings
(colab_xla.notebook.pipes, on real named pipes and a real ring in a temporary directory).
No replicas, no XLA, no kernel; times are given, never slept."""

import gc
import os
import select
import weakref

import pytest

from colab_xla.notebook import deadlines, partial_lines, pipes
from colab_xla.notebook.deadlines import Deadlines
from colab_xla.notebook.outcome import ReplicaOutcome
from colab_xla.notebook.partial_lines import PartialLines
from colab_xla.notebook.pipes import STARTUP, RunPipes
from colab_xla.wire import frames, ring
from colab_xla.wire.reports import ReplicaError

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]

# --- when a run is cut --------------------------------------------------------------------


def test_without_timeout_or_failure_no_deadline_ever_passes():
    d = Deadlines(timeout=None, now=0.0)
    assert d.timeout_at is None and d.fail_at is None
    assert d.passed(0.0) is None and d.passed(1e9) is None
    assert d.stop is None


def test_the_timeout_passes_at_its_deadline_not_before():
    d = Deadlines(timeout=2.5, now=10.0)
    assert d.timeout_at == 12.5
    assert d.passed(12.4999) is None
    assert d.passed(12.5) == "timeout"


def test_a_failure_gives_the_others_fail_fast_seconds_from_the_first_failure_only():
    d = Deadlines(timeout=None, now=0.0)
    d.failed(3, now=5.0)
    d.failed(1, now=6.0)  # a later failure moves nothing
    assert d.first_failed == 3
    assert d.fail_at == 5.0 + deadlines.FAIL_FAST_SECONDS
    assert d.passed(5.0 + deadlines.FAIL_FAST_SECONDS - 0.001) is None
    assert d.passed(5.0 + deadlines.FAIL_FAST_SECONDS) == "failed"


def test_the_timeout_is_the_reason_when_both_deadlines_passed():
    d = Deadlines(timeout=1.0, now=0.0)
    d.failed(0, now=0.5)
    assert d.passed(100.0) == "timeout"


def test_every_replica_must_start_within_the_start_bound_the_last_start_lifts_it():
    d = Deadlines(timeout=None, now=0.0, start=30.0, replicas=range(3))
    assert d.start_at == 30.0 and d.unstarted == [0, 1, 2]
    d.started(2)
    d.started(0)
    assert d.passed(29.999) is None
    assert d.passed(30.0) == "unstarted" and d.unstarted == [1]
    d.started(1)
    assert d.start_at is None and d.passed(1e9) is None


def test_no_start_bound_without_seconds_or_a_known_count():
    assert Deadlines(timeout=None, now=0.0, start=None, replicas=range(4)).start_at is None
    assert Deadlines(timeout=None, now=0.0, start=30.0).start_at is None


def test_a_start_after_the_cut_leaves_the_unstarted_named_and_told_apart():
    d = Deadlines(timeout=None, now=0.0, start=5.0, replicas=range(3))
    d.started(0)
    d.stop = d.passed(6.0)
    d.started(2)  # late: the run was cut for it
    assert d.unstarted == [1, 2]
    outcome = {o: ReplicaOutcome(o) for o in range(3)}
    late = d.stopped(outcome[1], outcome)
    assert (late.ename, late.kind) == ("NotStarted", "unstarted")
    assert "did not start the cell within 5 s" in late.evalue
    other = d.stopped(outcome[0], outcome)
    assert other.ename == "Stopped"
    assert "replicas 1-2 did not start the cell within 5 s" in other.evalue


def test_fail_fast_seconds_is_read_when_a_replica_fails(monkeypatch):
    monkeypatch.setattr(deadlines, "FAIL_FAST_SECONDS", 0.25)
    d = Deadlines(timeout=None, now=0.0)
    d.failed(0, now=1.0)
    assert d.fail_at == 1.25


def test_an_end_counts_only_before_the_cut_and_the_timeout():
    ended_at = frames.ENDED_AT.pack
    d = Deadlines(timeout=1.0, now=0.0)
    assert d.in_time(ended_at(0.999)) and d.in_time(ended_at(1.0))
    assert d.in_time(b"")  # no time sent (an older replica): counts
    assert d.stop is None
    assert not d.in_time(ended_at(1.001))  # read late, sent late: the run is over
    assert d.stop == "timeout"
    assert not d.in_time(ended_at(0.5))  # cut: nothing counts any more

    d = Deadlines(timeout=None, now=0.0)
    assert d.in_time(ended_at(1e9))
    d.stop = "interrupted"
    assert not d.in_time(ended_at(0.0)) and d.stop == "interrupted"


def _failed(ordinal):
    rep = ReplicaOutcome(ordinal)
    rep.error = ReplicaError("raised", "ValueError", "bad")
    return rep


def test_a_stopped_replica_is_told_why(monkeypatch):
    monkeypatch.setattr(deadlines, "FAIL_FAST_SECONDS", 1.5)  # read when it is said
    d = Deadlines(timeout=None, now=0.0)
    d.failed(2, now=0.0)
    d.stop = "failed"
    error = d.stopped(ReplicaOutcome(0), {2: _failed(2)})
    assert error.kind == "stopped"
    assert "stopped 1.5 s after replica 2 failed (ValueError)" in error.evalue

    d = Deadlines(timeout=0.75, now=0.0)
    d.stop = "timeout"
    error = d.stopped(ReplicaOutcome(0), {})
    assert error.kind == "timeout" and "--timeout 0.75 s" in error.evalue


# --- the pieces of C-level lines ------------------------------------------------------------


def test_ended_lines_are_shown_and_the_rest_is_held():
    held = PartialLines()
    assert held.ended(5, 0, frames.STDOUT, "a\nb\nhalf", now=1.0) == "a\nb\n"
    assert list(held.pieces) == [5]
    assert held.pieces[5] == partial_lines.Held("half", 0, frames.STDOUT, 1.0)
    assert held.ended(5, 0, frames.STDOUT, " more", now=1.1) == ""  # still no end: held
    assert held.pieces[5].text == "half more" and held.pieces[5].since == 1.0  # since first
    assert held.ended(5, 0, frames.STDOUT, "\nnext\n", now=1.2) == "half more\nnext\n"
    assert held.pieces == {}


def test_a_carriage_return_ends_a_progress_line():
    held = PartialLines()
    assert held.ended(5, 0, frames.STDERR, "10%\r20%\r", now=0.0) == "10%\r20%\r"
    assert held.pieces == {}


def test_each_pipe_holds_its_own_piece():
    held = PartialLines()
    assert held.ended(5, 0, frames.STDOUT, "out ", now=1.0) == ""
    assert held.ended(6, 0, frames.STDERR, "err ", now=2.0) == ""
    assert held.ended(6, 0, frames.STDERR, "done\n", now=3.0) == "err done\n"
    assert held.pieces[5].text == "out "


def test_held_pieces_are_due_after_partial_line_seconds_and_released_then(monkeypatch):
    monkeypatch.setattr(partial_lines, "PARTIAL_LINE_SECONDS", 0.5)  # read when asked
    held = PartialLines()
    held.ended(5, 0, frames.STDOUT, "prompt> ", now=10.0)
    held.ended(6, "process 0", frames.STDERR, "warn", now=10.25)
    assert held.due() == 10.5
    assert held.release(10.4999) == [] and len(held.pieces) == 2
    assert held.release(10.5) == [partial_lines.Held("prompt> ", 0, frames.STDOUT, 10.0)]
    assert held.due() == 10.75
    assert held.release() == [partial_lines.Held("warn", "process 0", frames.STDERR, 10.25)]
    assert held.pieces == {}


# --- reading a run's pipes and rings ------------------------------------------------------------


class _Reads:
    """What RunPipes hands on, in the order it does."""

    def __init__(self):
        self.seen = []

    def handle(self, frame):
        self.seen.append(("frame", frame.kind, frame.ordinal, frame.payload))

    def c_output(self, fd, rank, kind, data):
        self.seen.append(("c", rank, kind, data))


@pytest.fixture
def run_pipes(tmp_path):
    reads = _Reads()
    made = RunPipes(str(tmp_path), 2)
    made.begin(reads.handle, reads.c_output)
    yield made, reads
    made.close()


def _c_write(made, rank, kind, data):
    path = made.fd_paths[rank][0 if kind == frames.STDOUT else 1]
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def test_the_run_s_pipes_are_named_pipes_where_the_replicas_find_them(run_pipes, tmp_path):
    made, _ = run_pipes
    assert made.channel_path == str(tmp_path / "channel")
    assert made.startup_path == str(tmp_path / "startup")
    assert made.fd_paths == tuple((str(tmp_path / f"process-{r}.stdout"),
                                   str(tmp_path / f"process-{r}.stderr")) for r in range(2))
    assert sorted(made.fd_sources.values()) == sorted(
        [(STARTUP, frames.STDERR)] + [(r, k) for r in range(2)
                                      for k in (frames.STDOUT, frames.STDERR)])


def test_c_level_output_comes_after_the_frames_sent_before_it(run_pipes):
    made, reads = run_pipes
    writer = frames.ChannelWriter(made.write_fd)
    writer.send(frames.START, 1, b'{"rank": 1}')
    writer.send(frames.STDOUT, 1, b"from Python\n")
    _c_write(made, 1, frames.STDOUT, b"from C\n")
    c_fd = next(fd for fd, source in made.fd_sources.items() if source == (1, frames.STDOUT))
    assert select.select([c_fd], [], [], 10)[0] == [c_fd]
    assert made.read_one(c_fd)  # woken by the C-level line: the frames are handled first
    assert reads.seen == [("frame", frames.START, 1, b'{"rank": 1}'),
                          ("frame", frames.STDOUT, 1, b"from Python\n"),
                          ("c", 1, frames.STDOUT, b"from C\n")]


def test_a_ring_named_on_the_pipe_is_read_and_its_lines_merged(run_pipes, tmp_path):
    made, reads = run_pipes
    writer = frames.ChannelWriter(made.write_fd)
    writer.use_ring(str(tmp_path / "ring-0"), size=1 << 16)
    writer.send(frames.STDOUT, 0, b"one\n")
    writer.send(frames.STDOUT, 0, b"two\n")
    made.read_held()  # the pipe names the ring; the ring holds the lines
    assert list(made.rings) == [str(tmp_path / "ring-0")]
    assert reads.seen == [("frame", frames.STDOUT, 0, b"one\ntwo\n")]
    writer.drop_ring()


def test_a_ring_outside_the_run_s_directories_is_not_opened(run_pipes, tmp_path):
    made, reads = run_pipes
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    writer = frames.ChannelWriter(made.write_fd)
    writer.use_ring(str(elsewhere / "ring-0"), size=1 << 16)
    made.read_held()
    assert made.rings == {} and reads.seen == []
    writer.drop_ring()


def test_looking_at_the_rings_says_when_to_look_again(run_pipes, tmp_path, monkeypatch):
    monkeypatch.setattr(pipes, "RING_FLOW_SECONDS", 0.002)
    monkeypatch.setattr(pipes, "RING_POLL_SECONDS", 0.005)
    made, reads = run_pipes
    assert made.look(100.0, 101.0) == 101.0  # no ring: the caller's wake-up stands
    writer = frames.ChannelWriter(made.write_fd)
    writer.use_ring(str(tmp_path / "ring-0"), size=1 << 16)
    made.read_held()
    reader, _ = made.rings[str(tmp_path / "ring-0")]
    writer.send(frames.STDOUT, 0, b"flowing\n")
    assert made.look(100.0, 101.0) == 100.002  # output came: soon, no wake-up asked
    assert reads.seen[-1] == ("frame", frames.STDOUT, 0, b"flowing\n")
    assert reader._map[ring._WAITING] == 0
    assert made.look(100.0, 101.0) == 100.005  # none: a wake-up asked, and a poll
    assert reader._map[ring._WAITING] == 1
    assert made.look(100.0, 100.001) == 100.001  # an earlier wake-up stands
    writer.drop_ring()


def test_draining_reads_everything_the_pipes_hold(run_pipes, monkeypatch):
    monkeypatch.setattr(pipes, "READ_SIZE", 16)  # so that each pipe takes several reads
    made, reads = run_pipes
    writer = frames.ChannelWriter(made.write_fd)
    for ordinal in range(3):
        writer.send(frames.NOTE, ordinal, b'{"x": 1}')
    _c_write(made, 0, frames.STDERR, b"a C-level line longer than one read\n")
    fd = os.open(made.startup_path, os.O_WRONLY)
    os.write(fd, b"before the rank is known\n")
    os.close(fd)
    made.read_all_after_exit()
    assert [s[2] for s in reads.seen if s[0] == "frame"] == [0, 1, 2]
    assert b"".join(s[3] for s in reads.seen if s[:3] == ("c", 0, frames.STDERR)) == (
        b"a C-level line longer than one read\n")
    assert b"".join(s[3] for s in reads.seen if s[:3] == ("c", STARTUP, frames.STDERR)) == (
        b"before the rank is known\n")


def test_pipes_a_run_has_read_keep_nothing_of_it_alive(tmp_path):
    """The callbacks are the caller's methods: kept after the run, they would keep the
    Supervisor, its outcome and the values in it (shared pages a later run reuses) until a
    garbage collection."""
    reads = _Reads()
    reads.pipes = RunPipes(str(tmp_path), 1)
    reads.pipes.begin(reads.handle, reads.c_output)
    gone = weakref.ref(reads)
    reads.pipes.end()  # (a session's cell: the pipes stay open for the next)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del reads
        assert gone() is None  # freed at once
    finally:
        if was_enabled:
            gc.enable()
