"""What replicas display (``display(...)``, matplotlib's ``plt.show()``) reaches the notebook:
in a real kernel, in each view and in the saved notebook (the run's static form), under the
replica that showed it, in order with its lines.

The kernel tests' cells are one notebook, run once in one kernel (the ``notebook`` fixture,
:data:`CELLS`), as a user would run them one after another: each test reads its own cell
and what that cell's display ends as."""

from __future__ import annotations

import pytest

from colab_xla.notebook.output_log import OutputLog
from colab_xla.notebook.views import html as html_view, text as text_view
from colab_xla.wire.displays import Display
from test_kernel import WIDGET_VIEW, execute, stream_text

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(300), pytest.mark.stacks("colab")]

PLOTS = """%%xla_spawn -n 2{flags}
import matplotlib.pyplot as plt
from IPython.display import HTML, display
print("before", index)
if index == 1:
    plt.plot([0, 1], [1, 2])
    plt.show()
    display(HTML("<b id='from-replica'>replica one's table</b>"))
print("after", index)
"""


def _rows(summary_html: str):
    """The static form's section of each replica, by ordinal."""
    sections = summary_html.split("<details")[1:]
    return {int(section.split("</b>")[0].rsplit(" ", 1)[-1]): section for section in sections}


@pytest.fixture(scope="module")
def notebook():
    """:data:`CELLS`, run in one kernel: name -> (the executed notebook, that cell)."""
    nb = execute(*CELLS.values())
    return {name: (nb, nb.cells[1 + i]) for i, name in enumerate(CELLS)}  # (1: %load_ext)


@pytest.mark.xla
def test_a_replicas_figure_and_html_are_drawn_under_it_in_order_in_widget_and_saved_notebook(
        notebook):
    nb, cell = notebook["plots"]
    assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
    [shown] = [o for o in cell.outputs if o.output_type == "display_data"]
    rows = _rows(shown["data"]["text/html"])
    one = rows[1]
    assert "data:image/png;base64," in one and "id='from-replica'" in one
    # In order with the replica's lines: before, the figure, the HTML, after.
    marks = [one.index(m) for m in ("before 1", "data:image/png", "from-replica", "after 1")]
    assert marks == sorted(marks), one
    assert "data:image" not in rows[0] and "from-replica" not in rows[0]
    assert "[an image: image/png]" in shown["data"]["text/plain"]
    # What stays is the static form: no widget named (the live widget's tabs drew them as
    # display data: tests/test_browser.py sees it there).
    assert WIDGET_VIEW not in shown["data"]


@pytest.mark.xla
def test_the_text_view_shows_a_displays_text_form_and_says_where_it_is_drawn(notebook):
    _, cell = notebook["plots text"]
    text = stream_text(cell)
    assert "[replica 1] [an image: image/png]" in text, text
    assert ("[replica 1] (displayed image/png: the widget view and the saved notebook draw "
            "it)") in text
    assert "[replica 1] [a display: text/html]" in text
    # Replica 0 displayed nothing: none of its own lines is a display (the replicas'
    # lines interleave as they come, so its lines are picked out by their label).
    own = [line for line in text.splitlines() if line.startswith("[replica 0] ")]
    assert "[replica 0] after 0" in own and not [line for line in own if "image" in line]


def test_a_display_among_lines_is_one_line_of_the_log_and_the_summary_draws_it():
    log = OutputLog(path=None)
    log.write("stdout", "before\n")
    log.display(Display.of({"text/plain": "<Figure size 1x1>", "image/png": "AAAA"}))
    log.display(Display.of({"text/plain": "plain only"}))
    log.write("stdout", "after\n")
    lines = text_view.tail_lines(log, tail=None)
    assert lines == ["before", "[an image: image/png]", "plain only", "after"]
    drawn = html_view._output(lines)
    assert drawn.index("before") < drawn.index("data:image/png;base64,AAAA") < drawn.index(
        "plain only") < drawn.index("after")


BARS = """%%xla_spawn -n 2{flags}
import time
from tqdm.auto import tqdm
for step in tqdm(range(40), desc=f"train {{index}}", mininterval=0.05):
    time.sleep(0.01)
print("trained", index)
"""


@pytest.mark.xla
def test_a_tqdm_loop_is_a_bar_per_replica_that_reaches_its_total_never_a_flood(notebook):
    _, cell = notebook["bars"]
    assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
    [shown] = [o for o in cell.outputs if o.output_type == "display_data"]
    rows = _rows(shown["data"]["text/html"])
    for o in range(2):  # each replica's section: its bar, left as it ended, at its total
        assert "<progress value='1.000' max='1'" in rows[o], rows[o]
        assert f"train {o} 40/40" in rows[o], rows[o]  # (its whole line: in the output)
    # Its output has the bar's last line once, not a line per update.
    summary = shown["data"]["text/plain"]
    for o in range(2):
        assert summary.count(f"train {o}: 100%") == 1, summary
        assert summary.count(f"train {o}:") == 1, summary
        assert f"trained {o}" in summary


@pytest.mark.xla
def test_the_text_view_prints_a_bar_line_at_each_tenth_not_each_update(notebook):
    _, cell = notebook["bars text"]
    text = stream_text(cell)
    for o in range(2):
        lines = [line for line in text.splitlines() if line.startswith(f"[replica {o}] train {o}:")]
        assert 1 <= len(lines) <= 12, lines  # tenths, then the last line
        assert lines[-1].startswith(f"[replica {o}] train {o}: 100%"), lines
        assert "40/40" in lines[-1]


PICTURES = r'''%%xla_spawn -n 2
import matplotlib.pyplot as plt
class Picture:
    def _repr_png_(self):
        return b"\x89PNG\r\n\x1a\n" + bytes(16)
plt.figure(figsize=(2, 2))
plt.plot([0, index])          # no plt.show(): the inline backend shows it at the end
fig = plt.figure(figsize=(2, 2))
fig.gca().plot([1, 0])
Picture() if index == 0 else fig'''


@pytest.mark.xla
def test_figures_show_at_the_cells_end_without_show_and_a_pictures_value_is_drawn(notebook):
    _, cell = notebook["pictures"]
    assert not [o for o in cell.outputs if o.output_type == "error"], cell.outputs
    [shown] = [o for o in cell.outputs if o.output_type == "display_data"]
    rows = _rows(shown["data"]["text/html"])
    # Replica 0: its two figures, then its value's picture; replica 1: its two figures, and
    # its value is one of them, shown once.
    assert rows[0].count("data:image/png;base64,") == 3, rows[0]
    assert rows[1].count("data:image/png;base64,") == 2, rows[1]


CELLS = {"plots": PLOTS.format(flags=""), "plots text": PLOTS.format(flags=" --no-widget"),
         "bars": BARS.format(flags=""), "bars text": BARS.format(flags=" --no-widget"),
         "pictures": PICTURES}
