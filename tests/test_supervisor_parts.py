"""Units of what the run loop is made of, each alone: when a run is cut
(colab_xla.notebook.deadlines) and the pieces of C-level lines held back
(colab_xla.notebook.partial_lines). No replicas, no XLA, no kernel; times are given, never
slept."""

from colab_xla.notebook import deadlines, partial_lines
from colab_xla.notebook.deadlines import Deadlines
from colab_xla.notebook.outcome import ReplicaOutcome
from colab_xla.notebook.partial_lines import PartialLines
from colab_xla.wire import frames
from colab_xla.wire.reports import ReplicaError

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
