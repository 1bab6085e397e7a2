"""Output faults of issue #12: long lines, per-thread streams, split characters (pure
units), and what a replica displays (in a real kernel)."""

from __future__ import annotations

import pytest

from _kernel import Kernel  # tests/ is on sys.path
from colab_xla.notebook.output_log import OutputLog

pytestmark = [pytest.mark.stacks("colab", "kaggle")]

CHUNK = "x" * (1 << 16)  # what the notebook reads from the pipe at a time


class _CountedChunks(list):
    """A line's chunks, counting how many a reader walks back through."""

    walked = 0

    def __reversed__(self):
        for chunk in super().__reversed__():
            self.walked += 1
            yield chunk


@pytest.mark.quick
def test_a_long_line_without_newline_costs_its_length_not_its_length_squared():
    """16 MiB as one line, in 64 KiB chunks (what the notebook reads from the pipe at a
    time), a view drawing the growing line after each chunk. Before the fix each chunk
    copied the line so far (4 s for this line, against 0.03 s as 8 lines of 2 MiB). Counted,
    not timed: a chunk is kept as it came (no copy of the line per chunk), a draw walks back
    only through the chunks it shows, and the line is joined once, when it ends."""
    from colab_xla.notebook.output_log import PARTIAL_SHOWN

    log = OutputLog(path=None)
    log.write("stdout", CHUNK)
    chunks = log._partial["stdout"] = _CountedChunks(log._partial["stdout"])
    per_draw = PARTIAL_SHOWN // len(CHUNK) + 1  # the chunks a draw may need, at most
    for written in range(2, 257):
        log.write("stdout", CHUNK)
        assert log._partial["stdout"] is chunks and len(chunks) == written  # kept, not joined
        before = chunks.walked
        [(_, shown)] = log.partial()
        assert chunks.walked - before <= per_draw and shown.endswith("x")
    assert log.write("stdout", "\n") == ["x" * (16 << 20)] and log.partial() == []


@pytest.mark.quick
def test_chunks_of_one_line_join_with_carriage_returns_across_chunks():
    log = OutputLog(path=None)
    assert log.write("stdout", " 10%\r 5") == []
    assert log.partial() == [("stdout", " 5")]
    assert log.write("stdout", "0%\r") == []
    assert log.partial() == [("stdout", " 50%")]
    assert log.write("stdout", "100%\nnext") == ["100%"]
    assert log.partial() == [("stdout", "next")]
    assert log.finish() == ["next"] and log.lines_total == 2


@pytest.mark.quick
def test_a_view_of_a_growing_line_shows_its_end():
    log = OutputLog(path=None)
    for _ in range(64):
        log.write("stdout", CHUNK)
    log.write("stdout", "end")
    [(stream, shown)] = log.partial()
    assert shown.startswith("… x") and shown.endswith("xend") and len(shown) < 20000
    log.write("stdout", "\rdone")
    assert log.partial() == [("stdout", "done")]


class _Sink:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text
        return len(text)

    def flush(self):
        pass


@pytest.mark.quick
def test_each_thread_assigns_its_own_stream():
    import io
    import threading
    import types

    from colab_xla.replica.capture import _ReplicaSys, _ThreadStream

    default = _Sink()
    fake_sys = types.ModuleType("fake_sys")
    fake_sys.__dict__["stdout"] = dispatch = _ThreadStream(default)
    fake_sys.__class__ = _ReplicaSys
    mine = io.StringIO()
    fake_sys.stdout = mine  # what contextlib.redirect_stdout does
    assert fake_sys.stdout is mine
    seen = []
    other = threading.Thread(target=lambda: (seen.append(fake_sys.stdout),
                                             print("from another thread", file=dispatch)))
    other.start()
    other.join()
    print("from this thread", file=dispatch)  # print() goes through the module's dict
    assert seen == [default] and default.text == "from another thread\n"
    assert mine.getvalue() == "from this thread\n"
    fake_sys.stdout = dispatch  # restoring what was read from the dict: the default again
    assert fake_sys.stdout is default
    fake_sys.stdout = None  # legal: print() writes nothing
    print("dropped", file=dispatch)
    assert default.text == "from another thread\n"


@pytest.mark.quick
def test_bytes_split_inside_a_character_arrive_as_one_character():
    from colab_xla.replica.capture import _ReplicaBuffer

    sink = _Sink()
    buffer = _ReplicaBuffer(sink)
    assert buffer.write(b"caf\xc3") == 4
    buffer.write(memoryview(b"\xa9 \xff\n"))
    assert sink.text == "café \ufffd\n"


@pytest.mark.quick
def test_the_widget_view_redraws_a_long_line_as_its_start_only():
    from colab_xla.notebook.outcome import ReplicaOutcome, RunOutcome
    from colab_xla.notebook.views.widget import WidgetView

    outcome = RunOutcome("CPU", {0: ReplicaOutcome(0, "running")})
    view = WidgetView()
    view.opened(outcome)  # makes the widgets
    view.started(outcome, 0)
    log = outcome.replicas[0].log
    view.output(outcome, 0, log.write("stdout", "z" * (4 << 20) + "\n"))
    log.write("stdout", "w" * (4 << 20))  # and a long line still growing
    view.tick(outcome)
    combined = "".join(o["text"] for o in view.combined.outputs)
    tab = "".join(o["text"] for o in view._widgets.replicas[0][1].outputs)
    assert len(combined) < 20000 and "more characters in the log" in combined
    assert len(tab) < 40000 and tab.count("more characters in the log") == 1
    assert log.tail[0] == ("stdout", "z" * (4 << 20))  # the log keeps it whole


@pytest.mark.quick
def test_the_text_view_and_summaries_show_a_long_line_by_its_start():
    import io

    from colab_xla.notebook.views import html as html_view, text as text_view
    from colab_xla.notebook.outcome import ReplicaOutcome, RunOutcome

    outcome = RunOutcome("CPU", {0: ReplicaOutcome(0, "done", elapsed=1.0)})
    out = io.StringIO()
    view = text_view.TextView(out=out)
    view.output(outcome, 0, outcome.replicas[0].log.write("stdout", "q" * (4 << 20) + "\n"))
    view.closed(outcome)
    for shown in (out.getvalue(), text_view.render(outcome), html_view.render(outcome)):
        assert len(shown) < 40000 and "more characters in the log" in shown


@pytest.mark.quick
def test_a_thread_gets_the_replica_streams_back_when_its_cell_ends():
    """The thread pool of xmp.spawn may run a second replica on the thread of a first
    one that finished: what the first assigned to sys.stdout must not stay."""
    import io
    import types

    from colab_xla.replica.capture import _ReplicaSys, _restore_thread_streams, _ThreadStream

    default_out, default_err = _Sink(), _Sink()
    fake_sys = types.ModuleType("fake_sys")
    vars(fake_sys).update(stdout=_ThreadStream(default_out), stderr=_ThreadStream(default_err))
    fake_sys.__class__ = _ReplicaSys
    fake_sys.stdout, fake_sys.stderr = io.StringIO(), None  # the first replica's cell
    _restore_thread_streams(fake_sys)
    assert fake_sys.stdout is default_out and fake_sys.stderr is default_err


# -- in a real kernel ----------------------------------------------------------------------

PNG = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00"
       b"\x00\x1f\x15\xc4\x89\x00\x00\x00\rIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02\xfe\xa7"
       b"5\x81\x84\x00\x00\x00\x00IEND\xaeB`\x82")


@pytest.mark.faults
@pytest.mark.timeout(300)
@pytest.mark.stacks("colab")
def test_display_in_a_replica_shows_text_forms_in_the_text_view_and_says_where_it_is_drawn():
    with Kernel() as k:
        assert k.run("%load_ext colab_xla").status == "ok"
        reply = k.run(
            "%%xla_spawn -n 2 --no-widget\n"
            "from IPython.display import display, Image, HTML\n"
            "display({'replica': index})\n"
            f"for _ in range(3):\n    display(Image(data={PNG!r}, format='png'))\n"
            "display(HTML('<b>bold</b>'))\n"
            "print('after', index)")
        assert reply.status == "ok", reply.text
        text = reply.text
        for o in range(2):
            assert f"[replica {o}] {{'replica': {o}}}" in text, text
            assert f"[replica {o}] after {o}" in text, text
            assert text.count(f"[replica {o}] [an image: image/png]") == 3, text
            assert text.count(f"[replica {o}] (displayed image/png: the widget view") == 3
            assert f"[replica {o}] [a display: text/html]" in text, text
        assert "IPython.core.display" not in text  # no useless default reprs
        assert "not shown" not in text  # (only a widget is not)
