"""A replica's output log (colab_xla.notebook.output_log): lines from chunks, carriage
returns, a bounded tail, its file."""

import pytest

from colab_xla.notebook.output_log import OutputLog, collapse_cr

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


@pytest.mark.parametrize("line, shown", [("plain", "plain"), (" 10%\r 50%\r100%", "100%"),
                                         ("done\r", "done"), ("\r", "")])
def test_carriage_return_shows_the_last_rewrite(line, shown):
    assert collapse_cr(line) == shown


def test_log_joins_chunks_into_lines_per_stream_and_keeps_a_bounded_tail(tmp_path):
    log = OutputLog(str(tmp_path / "r.log"), tail_lines=3)
    assert log.write("stdout", "par") == []
    assert log.write("stderr", "warn\n") == ["warn"]
    assert log.write("stdout", "tial\nx\ny\nz") == ["partial", "x", "y"]
    assert log.partial() == [("stdout", "z")] and log.tail_text() == "partial\nx\ny\nz"
    assert log.finish() == ["z"]
    assert list(log.tail) == [("stdout", "x"), ("stdout", "y"), ("stdout", "z")]
    assert (log.lines_total, log.truncated) == (5, 2)
    assert (tmp_path / "r.log").read_text() == "parwarn\ntial\nx\ny\nz"  # everything, as written


def test_log_without_output_writes_no_file(tmp_path):
    log = OutputLog(str(tmp_path / "r.log"))
    log.finish()
    assert not (tmp_path / "r.log").exists() and log.tail_text() == ""
