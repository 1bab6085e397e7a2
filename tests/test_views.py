"""Choosing a view, and the text view taking over when the widget view fails (pure units)."""

import io
import itertools

import pytest

from colab_xla.notebook import views
from colab_xla.notebook.views import html as html_view, text as text_view
from colab_xla.notebook.outcome import ReplicaOutcome, RunOutcome
from colab_xla.notebook.outcome import RunObserver


pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def finished_outcome():
    outcome = RunOutcome("CPU", {0: ReplicaOutcome(0, "done", elapsed=0.5, value_repr="7")})
    outcome.replicas[0].log.write("stdout", "epoch 1\nepoch 2\n")
    outcome.elapsed = 0.6
    return outcome


class BrokenAt(RunObserver):
    def __init__(self, hook):
        self.hook, self.calls = hook, []

    def __getattribute__(self, name):
        if name in ("opened", "started", "output", "finished", "tick", "closed"):
            def hook(*args):
                self.calls.append(name)
                if name == self.hook:
                    raise AttributeError("'VBox' object has no attribute '_repr_mimebundle_'")
            return hook
        return object.__getattribute__(self, name)


def test_a_view_failing_at_the_end_gives_one_line_and_the_whole_text_summary():
    out = io.StringIO()
    view = views.FallbackView(BrokenAt("closed"), out=out)
    view.closed(finished_outcome())
    lines = out.getvalue().splitlines()
    assert lines[0] == ("colab_xla: the BrokenAt view failed (AttributeError: 'VBox' object has "
                        "no attribute '_repr_mimebundle_'); showing this run as text.")
    assert sum("view failed" in line for line in lines) == 1
    # The text view never printed the lines live, so its summary carries them.
    assert "\n".join(lines[1:]) == text_view.render(finished_outcome())
    assert view.failed.startswith("AttributeError")


def test_a_view_failing_at_the_start_hands_every_later_hook_to_the_text_view():
    out = io.StringIO()
    broken = BrokenAt("opened")
    view = views.FallbackView(broken, out=out)
    outcome = finished_outcome()
    view.opened(outcome)
    view.output(outcome, 0, ["live line"])
    view.tick(outcome)
    view.closed(outcome)
    assert broken.calls == ["opened"]  # never called again after it failed
    text = out.getvalue()
    assert text.count("view failed") == 1
    assert "[replica 0] live line\n" in text
    assert "epoch 2" in text and "Out: 7" in text


def test_a_working_view_is_left_alone():
    out = io.StringIO()
    inner = BrokenAt(None)
    view = views.FallbackView(inner, out=out)
    outcome = finished_outcome()
    for hook, args in (("opened", ()), ("started", (0,)), ("output", (0, ["x"])),
                       ("finished", (0,)), ("tick", ()), ("closed", ())):
        getattr(view, hook)(outcome, *args)
    assert inner.calls == ["opened", "started", "output", "finished", "tick", "closed"]
    assert out.getvalue() == "" and view.failed is None


def test_an_error_of_the_text_view_itself_is_raised_not_hidden():
    class BrokenText(text_view.TextView):
        def closed(self, outcome):
            raise RuntimeError("text view bug")

    with pytest.raises(RuntimeError, match="text view bug"):
        views.FallbackView(BrokenText(out=io.StringIO())).closed(finished_outcome())


def test_interrupts_pass_through_a_view():
    class Interrupted(RunObserver):
        def tick(self, outcome):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        views.FallbackView(Interrupted(), out=io.StringIO()).tick(finished_outcome())


class _Flushes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushes = 0

    def flush(self):
        self.flushes += 1


def test_the_text_views_summary_is_flushed_but_not_in_a_kernel_which_sends_it_itself():
    """A kernel sends what a cell printed before its next message (a display, an error,
    the reply); its flush waits for its IOPub thread. Elsewhere (a script's pipe) the
    summary is flushed as the run ends."""
    from ipykernel.iostream import OutStream

    class KernelStream(OutStream):  # (ipykernel's class, none of its threads)
        def __init__(self):
            self.written, self.flushes = [], 0

        def write(self, text):
            self.written.append(text)

        def flush(self):
            self.flushes += 1

    outcome = RunOutcome("CPU", {0: ReplicaOutcome(0, "done", elapsed=0.1)})
    for stream, flushes in ((_Flushes(), 1), (KernelStream(), 0)):
        text_view.TextView(out=stream).closed(outcome)
        written = stream.getvalue() if isinstance(stream, io.StringIO) else "".join(
            stream.written)
        assert "1 replica on CPU: 1 done" in written
        assert stream.flushes == flushes, type(stream).__name__


def test_the_text_view_is_chosen_without_a_kernel_or_when_asked():
    assert type(views.choose("auto", has_kernel=False)) is text_view.TextView
    assert type(views.choose("text", has_kernel=True)) is text_view.TextView


def test_the_widget_view_is_chosen_in_a_kernel():
    pytest.importorskip("ipywidgets")
    from colab_xla.notebook.views.widget import WidgetView

    chosen = views.choose("auto", has_kernel=True)
    assert isinstance(chosen, views.FallbackView) and isinstance(chosen.view, WidgetView)


def test_the_widget_display_data_is_what_ipywidgets_itself_displays(monkeypatch):
    """ipywidgets 8 says it through _repr_mimebundle_, 7 through _ipython_display_."""
    widgets = pytest.importorskip("ipywidgets")
    from colab_xla.notebook.views.widget import widget_bundle

    box = widgets.VBox([widgets.HTML("x")])
    shown = []
    if hasattr(box, "_repr_mimebundle_"):
        shown.append(box._repr_mimebundle_())
    else:  # ipywidgets 7: capture what its _ipython_display_ hands to display()
        import ipywidgets.widgets.widget as widget_module

        monkeypatch.setattr(widget_module, "display",
                            lambda data, raw=False: shown.append(data))
        box._ipython_display_()
    key = "application/vnd.jupyter.widget-view+json"
    assert widget_bundle(box) == {key: shown[0][key]}
    assert shown[0][key]["model_id"] == box.model_id


class Handle:
    """What ``display(data, display_id=True)`` returns, keeping what it showed first
    (``data``) and each update."""

    def __init__(self, data):
        self.shown = [data]

    def update(self, data, raw=False):
        self.shown.append(data)


@pytest.fixture
def widget_view(monkeypatch):
    """``(the widget view's module, the handles of its displays)``: its displays made into
    :class:`Handle` s, and its live runs its own for the test."""
    pytest.importorskip("ipywidgets")
    from colab_xla.notebook.views import widget as widget_view

    handles = []
    monkeypatch.setattr(widget_view, "display",
                        lambda data, **k: handles.append(Handle(data)) or handles[-1])
    monkeypatch.setattr(widget_view, "_live", widget_view.collections.deque())
    monkeypatch.setattr(widget_view, "_spare", widget_view.collections.deque())
    return widget_view, handles


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _start(view, outcome, replicas, line="line {o}") -> None:
    """Replicas ``replicas`` (a count: 0 to ``replicas - 1``) start, and print ``line``
    each (if given: ``{o}`` is the replica's ordinal)."""
    for o in range(replicas) if isinstance(replicas, int) else replicas:
        outcome.replica(o)
        view.started(outcome, o)
        if line:
            view.output(outcome, o, [line.format(o=o)])


def test_every_run_ends_as_its_static_form_and_the_kernel_keeps_one_runs_widgets(widget_view):
    """Issue #12: every run left ~31 live widgets in the kernel for good. Issue 55: a saved
    notebook showed "Error displaying widget: model not found" for its last runs, whose
    final display still named the widget. Now each run's display ends without the widget,
    as its static form (HTML and text), and its widgets are the next run's."""
    widget_view, handles = widget_view

    def live():
        return {id(w) for w in widget_view._registry().values()}

    before, per_run = live(), []
    for run in range(4):
        view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
        view.opened(outcome)
        _start(view, outcome, 3)
        view.tick(outcome)
        outcome.elapsed = 0.1
        view.closed(outcome)
        per_run.append(len(live() - before))
    assert per_run == [per_run[0]] * 4 and per_run[0] > 0
    assert len(handles) == 4
    for handle in handles:
        first, last = handle.shown[0], handle.shown[-1]
        assert WIDGET_VIEW in first  # (live while it ran)
        assert set(last) == {"text/plain", "text/html"}, last
        assert "colab-xla-summary" in last["text/html"]


def test_a_run_makes_few_widgets_sharing_one_layout(widget_view):
    """Issue #18: each widget is a comm message the launch waits for; a run of 8 replicas
    made 89 (a layout, and a style, per widget). Now: one layout and one style for the run,
    a replica's error widget only if it fails, its error shown in its own tab."""
    import ipywidgets as widgets

    from colab_xla.wire.reports import ReplicaError

    widget_view, _ = widget_view
    before = set(widget_view._registry())
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 8)
    view.tick(outcome)
    for o in range(8):
        rep = outcome.replicas[o]
        rep.state, rep.elapsed = ("failed", 0.2) if o == 5 else ("done", 0.1)
        if o == 5:
            rep.error = ReplicaError(kind="exception", ename="ValueError", evalue="five",
                                     traceback="ValueError: five\n")
    outcome.elapsed = 0.3
    view.tick(outcome)  # (the last draw of the live widget)
    made = [w for model_id, w in widget_view._registry().items() if model_id not in before]
    assert len(made) == 6 + 3 * 8 + 1
    assert len({w.layout.model_id for w in made if hasattr(w, "layout")}) == 1
    assert len({w.style.model_id for w in made if isinstance(w, widgets.HTML)}) == 1
    pages = view.tabs.children[1:]
    assert [len(page.children) for page in pages] == [2] * 5 + [3] + [2] * 2
    assert "ValueError: five" in pages[5].children[2].value
    titles = (list(view.tabs.titles) if hasattr(view.tabs, "titles")
              else [view.tabs._titles[str(i)] for i in range(9)])
    assert titles == ["all"] + [f"{o} {'✗' if o == 5 else '✓'}" for o in range(8)]
    view.closed(outcome)


_RUNS = itertools.count()


def _one_run(widget_view, replicas: int, failed=(), lines=True, close=True):
    """A run of ``replicas`` replicas that print a line each (if ``lines``); those in
    ``failed`` fail, the others are done; its view, closed if ``close`` (after its last
    draw: ``view.drawn_box`` is the box it drew, which the end frees)."""
    from colab_xla.wire.reports import ReplicaError

    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, replicas, lines and f"line {{o}} of run {next(_RUNS)}")
    view.tick(outcome)
    for o in range(replicas):
        rep = outcome.replicas[o]
        rep.state, rep.elapsed = ("failed", 0.2) if o in failed else ("done", 0.1)
        if o in failed:
            rep.error = ReplicaError(kind="exception", ename="ValueError", evalue=f"{o}",
                                     traceback=f"ValueError: {o}\n")
        rep.log.write("stdout", f"own line of {o}\n" if lines else "")
    view.outcome, view.drawn_box = outcome, view.box
    if close:
        outcome.elapsed = 0.3
        view.tick(outcome)
        view.closed(outcome)
    return view


def _shown(box):
    """What a run's box shows: the combined tab's text, and per replica tab its
    widgets' values and output texts."""
    combined, *pages = box.children[1].children
    return ("".join(o["text"] for o in combined.outputs),
            [[getattr(w, "value", None) or "".join(o["text"] for o in w.outputs)
              for w in page.children] for page in pages])


def test_an_ended_runs_widgets_are_made_over_for_the_next_run_showing_only_its_own(
        widget_view, monkeypatch):
    """Issue #18: a run's widgets were each opened (a comm message the cell waits for),
    then closed five runs later; a warm session cell spent most of its widget view's time
    on them. Now the next run of as many replicas opens no widget at all, and is displayed
    only once drawn over, showing nothing of the run before."""
    widget_view, handles = widget_view
    first = _one_run(widget_view, 2, failed=(1,), close=False)
    first.outcome.elapsed = 0.3
    first.tick(first.outcome)  # (its last draw: the failed replica's error widget)
    drawn = dict(widget_view._registry())
    first.closed(first.outcome)
    before, first_box = dict(widget_view._registry()), first.drawn_box
    assert first.box is None  # (freed at its end)
    # Closed at its end: its error widget (the tab it was in is made over without it).
    assert ["ValueError: 1" in drawn[k].value for k in set(drawn) - set(before)] == [True]
    at_display = []  # what the box showed when it was displayed
    fake_display = widget_view.display
    monkeypatch.setattr(widget_view, "display", lambda data, **k: at_display.append(
        _shown(first_box)) or fake_display(data, **k))
    reused = _one_run(widget_view, 2, lines=False)
    assert reused.drawn_box is first_box
    assert len(at_display) == 1
    combined, pages = at_display[0]
    assert "run" not in combined and len(pages) == 2 and "run 0" not in str(pages)
    assert not any("own line" in str(page) or "done" in str(page) for page in pages)
    after = dict(widget_view._registry())
    assert set(after) == set(before)  # no widget opened, none closed
    assert WIDGET_VIEW not in handles[0].shown[-1]
    assert handles[-1].shown[0][WIDGET_VIEW]["model_id"] == first_box.model_id
    assert WIDGET_VIEW not in handles[-1].shown[-1]
    combined, pages = _shown(first_box)  # nothing of the first run: its lines, its error
    assert "run" not in combined and len(pages) == 2
    assert [len(page) for page in pages] == [2, 2] and "run 0" not in str(pages)
    assert all("<b>done</b>" in page[0] for page in pages)


@pytest.mark.parametrize("replicas", [4, (0, 2)])
def test_an_ended_runs_widgets_made_over_open_on_the_all_tab(widget_view, replicas):
    """The last run's person looked at replica 2's tab: a new run (of as many replicas, or
    of replicas 0 and 2: ``--targets 0,2``) opened on its replica 2's tab, or on replica
    0's."""
    widget_view, _ = widget_view
    first = _one_run(widget_view, 4, close=False)
    first.tabs.selected_index = 3  # replica 2's tab ("all" is 0)
    first.outcome.elapsed = 0.3
    first.closed(first.outcome)
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, replicas)
    view.tick(outcome)
    assert view.box is first.drawn_box  # (made over)
    assert view.tabs.selected_index == 0
    assert view._shown_replica() is None  # the combined tab's


def test_a_run_as_large_as_the_ended_one_sends_no_tab_and_no_title(widget_view, monkeypatch):
    """Its widgets keep the last run's tabs and titles until it draws them over: a run of
    as many replicas, drawn as that run was, sends neither. (They were cleared first, then
    drawn again: 2 tab and 3 title messages.)"""
    import ipywidgets as widgets

    widget_view, _ = widget_view
    _one_run(widget_view, 2)
    sent, notify = [], widgets.Widget.notify_change  # (where a change is sent, if synced)

    def notify_change(self, change):
        if change["name"] in self.keys:
            sent.append((type(self).__name__, change["name"]))
        return notify(self, change)

    monkeypatch.setattr(widgets.Widget, "notify_change", notify_change)
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 2)
    for rep in outcome.replicas.values():
        rep.state, rep.elapsed = "done", 0.1
    view.tick(outcome)
    outcome.elapsed = 0.2
    view.closed(outcome)
    assert sent and not [(kind, trait) for kind, trait in sent if kind == "Tab"], sent


def test_a_run_is_displayed_at_its_first_draw_and_ends_as_its_static_form(widget_view):
    """Shown once drawn: a short cell is one display (its end: the static form, with no
    widget), a longer one a live display (at its first draw) updated to it at its end."""
    widget_view, handles = widget_view
    for draws in (0, 1):
        before = set(widget_view._registry())
        view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
        view.opened(outcome)
        _start(view, outcome, 2)
        shown_at_open = len(handles)
        for _ in range(draws):
            view.tick(outcome)
        box = view.box
        for rep in outcome.replicas.values():
            rep.state, rep.elapsed = "done", 0.1
        outcome.elapsed = 0.2
        view.closed(outcome)
        assert len(handles) == shown_at_open + 1
        first, *updates = handles[-1].shown
        if draws:
            assert first[WIDGET_VIEW]["model_id"] == box.model_id
            assert first["text/plain"] == widget_view.LIVE_TEXT and len(updates) == 1
            assert updates[0] == html_view.bundle(outcome)
        else:
            assert box is None and set(widget_view._registry()) == before  # none made
            assert first == html_view.bundle(outcome) and not updates
        assert handles[-1].shown[-1]["text/plain"].startswith("2 replicas on CPU: 2 done")


def test_a_run_that_ends_before_its_first_draw_is_its_static_form_alone(widget_view):
    """A warm cell such as ``x = 1``: it ended before its first draw. Its static form
    (text and HTML, what a saved notebook shows) says all its widget would: it is displayed
    alone, with no widget made, made over or retired, and no earlier run's display updated."""
    widget_view, handles = widget_view
    _one_run(widget_view, 2)
    before, spare = set(widget_view._registry()), list(widget_view._spare)
    shown, updates = len(handles), [len(h.shown) for h in handles]
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 2, line="printed {o}")
    for o, rep in outcome.replicas.items():
        rep.state, rep.elapsed, rep.value_repr = "done", 0.1, repr(o)
        rep.log.write("stdout", f"printed {o}\n")
    outcome.elapsed = 0.2
    view.closed(outcome)
    assert set(widget_view._registry()) == before and list(widget_view._spare) == spare
    assert len(handles) == shown + 1
    assert [len(h.shown) for h in handles[:shown]] == updates
    summary = handles[-1].shown[0]
    assert set(summary) == {"text/plain", "text/html"}
    assert summary["text/plain"] == text_view.render(outcome)
    assert "Out: 1" in summary["text/plain"] and "<code>1</code>" in summary["text/html"]
    assert "printed 1" in summary["text/html"]


def test_a_run_with_more_replicas_than_the_ended_run_makes_only_the_widgets_it_lacks(
        widget_view):
    widget_view, _ = widget_view
    _one_run(widget_view, 1)
    before = set(widget_view._registry())
    view = _one_run(widget_view, 3)
    assert len(set(widget_view._registry()) - before) == 2 * 3  # replicas 1 and 2
    assert [page[1] for page in _shown(view.drawn_box)[1]] == [
        f"own line of {o}\n" for o in range(3)]


def test_a_replicas_tab_comes_when_it_starts_and_makes_only_its_own_widgets(widget_view):
    widget_view, _ = widget_view
    before = set(widget_view._registry())
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    assert set(widget_view._registry()) == before  # (its widgets come at its first draw)
    view.tick(outcome)
    made = set(widget_view._registry()) - before
    for started in ([0, 2], [1]):  # replica 1 starts after 2
        _start(view, outcome, started, line=None)
        outcome.replicas[started[-1]].state = "done"
        view.tick(outcome)
        assert len(set(widget_view._registry()) - before - made) == 3 * len(started)
        made = set(widget_view._registry()) - before
        assert [page[0].split(" · ")[:2] for page in _shown(view.box)[1]] == [
            [f"replica {o}", f"<b>{outcome.replicas[o].state}</b>"]
            for o in sorted(outcome.replicas)]


def test_a_live_display_whose_end_never_came_is_retired_by_the_next_run(widget_view):
    """Its view failed (the text view took over) or its run raised: the next run closes its
    widgets rather than making them over, and its display no longer names a widget."""
    widget_view, handles = widget_view
    before = set(widget_view._registry())
    cut = _one_run(widget_view, 2, close=False)
    widgets_of_cut = [w for k, w in widget_view._registry().items() if k not in before]
    cut_handle = handles[-1]
    assert WIDGET_VIEW in cut_handle.shown[-1]
    _one_run(widget_view, 2)
    assert all(w.comm is None for w in widgets_of_cut)  # closed
    assert cut.box is None and cut_handle.shown[-1] == {"text/plain": widget_view.ABANDONED_TEXT}
    assert not {id(w) for w in widget_view._spare[0].all()} & {id(w) for w in widgets_of_cut}


def test_a_run_of_fewer_replicas_keeps_the_others_widgets_and_closing_its_own_closes_them(
        widget_view, monkeypatch):
    widget_view, _ = widget_view
    before = set(widget_view._registry())
    _one_run(widget_view, 3)
    made = [w for k, w in widget_view._registry().items() if k not in before]
    fewer = _one_run(widget_view, 1)  # it takes a run of 3's widgets, and shows 1 tab
    assert len(_shown(fewer.drawn_box)[1]) == 1
    assert fewer.drawn_box.model_id in {w.model_id for w in made}
    monkeypatch.setattr(widget_view, "SPARE_RUNS", 0)  # from here on, ended runs close
    _one_run(widget_view, 1)
    assert all(w.comm is None for w in made)  # every one of the runs of 3, closed


def test_the_widget_view_only_keeps_lines_as_they_come_and_draws_a_flood_as_its_last_rows(
        widget_view):
    """The read loop hands every piece of output to the view (issue 31: one piece of 20,000
    lines per replica kept a session cell 39x longer under the widget view than under the
    text view, its replicas blocked on a full pipe). The view only keeps them, a bounded
    number, until its draw merges them: the combined tab's last rows, and a row that says
    how many lines it skipped."""
    widget_view, _ = widget_view
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 4)
    view.tick(outcome)
    rows_before = list(view._lines)
    flood = 100_000
    for o in range(4):
        view.output(outcome, o, [f"r{o} line {i}" for i in range(flood)])
        assert list(view._lines) == rows_before  # nothing merged by the read loop
        assert len(view._pending) == widget_view.PENDING_LINES
    view.tick(outcome)
    rows = "".join(o["text"] for o in view.combined.outputs).splitlines()
    last = widget_view.COMBINED_LINES
    assert rows == [f"[replica 3] r3 line {i}" for i in range(flood - last, flood)]
    assert not view._pending and view._skipped == 0
    # Nine replicas print the same lines, a few more than the view keeps: each line is one
    # row, under the note of the lines skipped (the first three replicas' first line).
    outcome2 = RunOutcome("CPU")
    view2 = widget_view.WidgetView()
    view2.opened(outcome2)
    _start(view2, outcome2, 9, line=None)
    steps = widget_view.PENDING_LINES // 9 + 1
    for i in range(steps):
        for o in range(9):
            view2.output(outcome2, o, [f"step {i}"])
    view2.tick(outcome2)
    rows = "".join(o["text"] for o in view2.combined.outputs).splitlines()
    skipped = 9 * steps - widget_view.PENDING_LINES
    assert 0 < skipped < 9
    assert rows[0] == (f"... {skipped} lines not shown here (each replica's tab has its "
                       "latest lines, its log all of them)")
    assert rows[1] == f"[replicas {skipped}-8] step 0"
    assert rows[2:] == [f"[all 9] step {i}" for i in range(1, steps)]
    view.retire()
    view2.retire()
    assert view.box is None is view2.box


def test_the_widget_view_merges_a_line_printed_by_every_replica_across_draws(widget_view):
    widget_view, _ = widget_view
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 3)
    view.output(outcome, 0, ["step 1"])
    view.tick(outcome)  # replica 0's row is drawn, then the others print the same line
    view.output(outcome, 1, ["step 1"])
    view.output(outcome, 2, ["step 1", "mine"])
    view.tick(outcome)
    rows = "".join(o["text"] for o in view.combined.outputs).splitlines()
    assert rows[-2:] == ["[all 3] step 1", "[replica 2] mine"]


def test_the_all_tab_draws_each_replicas_own_plot_under_its_label_and_a_shared_one_once(
        widget_view):
    """Four replicas' different plots were one row, ``[all 4] [an image: image/png]``: their
    text forms are alike, so they read as one image, and none was drawn."""
    from colab_xla.wire.displays import Display

    widget_view, _ = widget_view
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 4, line=None)

    def plot(data):
        return Display.of({"text/plain": "<Figure size 640x480 with 1 Axes>",
                           "image/png": data})

    for shown in ([plot(f"PLOT{o}") for o in range(4)], [plot("SHARED")] * 4, ["done"] * 4):
        for o in range(4):  # (each step's output of every replica, in turn)
            view.output(outcome, o, [shown[o]])
    view.tick(outcome)
    outputs = view.combined.outputs
    drawn = [o["data"]["image/png"] for o in outputs if o["output_type"] == "display_data"]
    assert drawn == ["PLOT0", "PLOT1", "PLOT2", "PLOT3", "SHARED"]
    rows = [o["text"] if o["output_type"] == "stream" else o["data"]["image/png"]
            for o in outputs]
    assert rows == ["[replica 0] [an image: image/png]\n", "PLOT0",
                    "[replica 1] [an image: image/png]\n", "PLOT1",
                    "[replica 2] [an image: image/png]\n", "PLOT2",
                    "[replica 3] [an image: image/png]\n", "PLOT3",
                    "[all 4] [an image: image/png]\n", "SHARED", "[all 4] done\n"]
    view.retire()


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_left_tqdm_bar_is_drawn_once_in_its_replicas_tab_not_again_as_stderr(widget_view):
    """The tab's state draws a left bar as it ended; its last line came again under it, as
    stderr (the frontend's pink error background). Every other view keeps that line among
    the replica's output: it is all they show of the bar."""
    from _runs import run  # tests/ is on sys.path

    widget_view, _ = widget_view
    view = widget_view.WidgetView()
    outcome = run("""
        from tqdm.auto import tqdm
        for _ in tqdm(range(5), desc=f"bar{index}", mininterval=0):
            pass
        print("after", index)
        """, 2, observer=view)
    view.tick(outcome)  # (the live widget's last draw)
    assert outcome.ok, outcome
    for o in range(2):
        state, out, _ = view._widgets.replicas[o]
        assert [x.get("name") for x in out.outputs] == ["stdout"], out.outputs
        assert out.outputs[0]["text"] == f"after {o}\n"
        assert state.value.count(f"bar{o}: 100%") == 1 and "5/5" in state.value, state.value
        assert text_view.render(outcome).count(f"bar{o}: 100%") == 1
        assert html_view.render(outcome).count(f"bar{o}: 100%") == 1
    view.closed(outcome)


def test_the_header_says_where_replicas_are_while_none_prints_and_where_stopped_ones_were(
        widget_view):
    from colab_xla.notebook.outcome import Stall
    from colab_xla.notebook.views import text as text_view
    from colab_xla.wire.reports import ReplicaError

    widget_view, _ = widget_view
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 3)
    stall = Stall(61.4, {0: "line 9: `xm.rendezvous('r')`", 1: "line 5 in f: `sleep(9)`",
                         2: "line 9: `xm.rendezvous('r')`"})
    view.stalled(outcome, stall)
    view.tick(outcome)
    assert ("No output for 61 s; where each replica is now:\nreplicas 0, 2 at line 9: "
            "`xm.rendezvous(&#x27;r&#x27;)`\nreplica 1 at line 5 in f: `sleep(9)`"
            ) in view.header.value, view.header.value
    view.stalled(outcome, None)  # output again: it goes
    view.tick(outcome)
    assert "No output for" not in view.header.value
    for o in range(3):  # then the run is cut
        rep = outcome.replicas[o]
        rep.state, rep.elapsed = "stopped", 0.5
        rep.error = ReplicaError("interrupted", "KeyboardInterrupt", "interrupted while running",
                                 place=stall.places[o])
    outcome.elapsed, outcome.interrupted = 0.6, True
    view.tick(outcome)
    assert "replica 1 at line 5 in f: `sleep(9)`" in view.header.value
    printed = io.StringIO()
    text = text_view.TextView(out=printed)
    for told in (stall, stall, None, stall):  # printed once per new set of places
        text.stalled(outcome, told)
    assert printed.getvalue().count("[colab_xla] No output for 61 s") == 2
    assert "[colab_xla] replica 1 at line 5 in f: `sleep(9)`\n" in printed.getvalue()


def test_the_headers_time_counts_from_the_cells_start_a_replicas_from_its_own(widget_view):
    """Issue 55: the live header's time began at the view's opening, after the start-up
    (a 3.4 s cell read "0.1 s"); it is the wait since the cell began, as the end's headline
    (its static form's and the text form's), a replica's tab its own time."""
    import re
    import time

    widget_view, handles = widget_view
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU", began=time.monotonic() - 90)
    view.opened(outcome)
    _start(view, outcome, 2)
    view.tick(outcome)
    waited = float(re.search(r"<b>running</b> · (\d+\.\d) s", view.header.value)[1])
    assert waited >= 90, view.header.value
    status = view._widgets.replicas[0][0].value
    assert float(re.search(r"<b>running</b> · (\d+\.\d) s", status)[1]) < 90, status
    for o in range(2):
        outcome.replicas[o].state, outcome.replicas[o].elapsed = "done", 0.5
    outcome.elapsed = time.monotonic() - outcome.began
    view.closed(outcome)
    end = handles[-1].shown[-1]
    for form in (end["text/plain"], end["text/html"]):
        took = float(re.search(r"2 replicas on CPU: 2 done in (\d+\.\d\d) s", form)[1])
        assert took >= 90, form


def test_a_hidden_tabs_output_is_sent_every_few_seconds_the_shown_tabs_at_every_draw(
        widget_view, monkeypatch):
    """Under heavy output each send is a tab's last lines, whole: the tabs no one looks at
    are sent again every HIDDEN_OUTPUT_SECONDS, the shown one at every draw, all at the end."""
    widget_view, _ = widget_view
    clock = [100.0]
    monkeypatch.setattr(widget_view.time, "monotonic", lambda: clock[0])
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 3)
    view.tick(outcome)  # the first draw: every tab
    outputs = {o: view._widgets.replicas[o][1] for o in range(3)}
    view.tabs.selected_index = 2  # replica 1's tab is shown ("all" is 0)

    def texts():
        return {o: "".join(x.get("text", "") for x in out.outputs)
                for o, out in outputs.items()}

    for step in range(3):
        clock[0] += 0.25
        for o in range(3):
            view.output(outcome, o, [f"more {o}.{step}"])
            outcome.replica(o).log.write("stdout", f"more {o}.{step}\n")
        view.tick(outcome)
    now = texts()
    assert "more 1.2" in now[1]  # the shown tab: at every draw
    assert "more 0." not in now[0] and "more 2." not in now[2]  # hidden: not yet
    clock[0] += widget_view.HIDDEN_OUTPUT_SECONDS
    view.tick(outcome)
    assert all(f"more {o}.2" in texts()[o] for o in range(3))  # their turn came
    outcome.replica(0).log.write("stdout", "last 0\n")
    for rep in outcome.replicas.values():
        rep.state, rep.elapsed = "done", 1.0
    outcome.elapsed = 1.0
    view.tick(outcome)
    assert "last 0" in texts()[0]  # the last draw sends every tab's


# The tags and attributes JupyterLab 4's sanitizer keeps in an untrusted notebook (its
# allow-list in @jupyterlab/apputils' sanitizer, for the tags the static form uses).
SANITIZER_KEEPS = {"div": {"class", "style"}, "p": {"style"}, "b": set(), "span": {"style"},
                   "code": set(), "pre": {"style"}, "details": {"class", "style", "open"},
                   "summary": set(), "img": {"src", "alt", "style"},
                   "progress": {"value", "max", "style"}}


def _tags(fragment: str):
    """``[(tag, {attribute: value})]`` of an HTML fragment, and its text."""
    from html.parser import HTMLParser

    found, text = [], []

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.append((tag, dict(attrs)))

        def handle_data(self, data):
            text.append(data)

    Parser().feed(fragment)
    return found, "".join(text)


def _static_outcome():
    from colab_xla.wire.displays import Display
    from colab_xla.wire.reports import ReplicaError

    outcome = RunOutcome("CPU")
    for o, state in enumerate(("done", "stopped", "failed", "done")):
        rep = outcome.replica(o)
        rep.state, rep.elapsed = state, 0.25 * (o + 1)
        rep.log.write("stdout", f"<script>alert({o})</script> & line of {o}\n")
    ok = outcome.replicas[0]
    ok.value_repr = "<b>not bold</b>"
    ok.log.display(Display.of({"text/plain": "<Figure>", "image/png": "iVBORw0KGgo="}))
    ok.log.write("stdout", "after the figure\n")
    ok.progress["b"] = {"n": 5, "total": 10, "desc": "steps", "text": "steps: 50%"}
    outcome.replicas[2].error = ReplicaError(
        kind="exception", ename="ValueError", evalue="<two>",
        traceback="Traceback\n  Cell In[3], line 2\nValueError: <two>\n")
    outcome.replicas[1].error = ReplicaError(
        "interrupted", "KeyboardInterrupt", "stopped after replica 2 failed",
        place="line 5: `xm.rendezvous('<r>')`")
    outcome.elapsed = 1.5
    return outcome


def test_the_static_form_has_a_section_per_replica_failed_first_and_open():
    outcome = _static_outcome()
    page = html_view.render(outcome)
    sections = page.split("<details")[1:]
    assert [s.split("</b>")[0].rsplit(">", 1)[-1] for s in sections] == [
        "replica 2", "replica 1", "replica 0", "replica 3"]
    assert [" open>" in s.split("<summary>")[0] for s in sections] == [True, True, False, False]
    failed, stopped, ok, _ = sections
    assert "✗ failed</span> · 0.75 s" in failed and "ValueError: &lt;two&gt;</span>" in failed
    assert "Cell In[3], line 2" in failed  # (the whole traceback, in its body)
    assert "at line 5: `xm.rendezvous(&#x27;&lt;r&gt;&#x27;)`" in stopped
    assert "Out: <code>&lt;b&gt;not bold&lt;/b&gt;</code></summary>" in ok
    # Its output in order: the line, the figure, the line after it; then its bar.
    marks = [ok.index(m) for m in ("line of 0", "data:image/png;base64,iVBORw0KGgo=",
                                    "after the figure", "<progress value='0.500'")]
    assert marks == sorted(marks), ok
    assert "<b>4 replicas on CPU: 2 done, 1 failed, 1 stopped in 1.50 s</b>" in page
    assert "results in" not in page
    # Where -o put the results (issue 55): one clause of the headline, in both forms.
    outcome.stored_as, outcome.kept = "<outs>", ["--pull model"]
    page, text = html_view.render(outcome), text_view.render(outcome)
    assert ("<b>4 replicas on CPU: 2 done, 1 failed, 1 stopped in 1.50 s</b> · results in "
            "<code>&lt;outs&gt;</code> · <code>--pull model</code> kept its earlier value"
            ) in page, page
    assert text.splitlines()[0] == ("4 replicas on CPU: 2 done, 1 failed, 1 stopped in 1.50 s"
                                    " · results in `<outs>` · `--pull model` kept its earlier "
                                    "value")
    outcome.stored_as, outcome.kept = None, []
    # With none failed or stopped, the first replica is open.
    for rep in outcome.replicas.values():
        rep.state, rep.error = "done", None
    sections = html_view.render(outcome).split("<details")[1:]
    assert [" open>" in s.split("<summary>")[0] for s in sections] == [True, False, False, False]


def test_the_static_form_is_escaped_and_uses_only_what_a_sanitizer_keeps():
    """Replica output is the user's and the data's: as text, never markup. And an untrusted
    notebook's sanitizer keeps all of it: no script, no <style>, no id, no command linker."""
    outcome = _static_outcome()
    page = html_view.render(outcome)
    tags, text = _tags(page)
    assert "<script>" not in page and "&lt;script&gt;alert(2)&lt;/script&gt; &amp; line" in page
    for o in range(4):
        assert f"<script>alert({o})</script> & line of {o}" in text  # (read as text)
    for tag, attrs in tags:
        assert tag in SANITIZER_KEEPS, tag
        assert set(attrs) <= SANITIZER_KEEPS[tag], (tag, attrs)
    bundle = html_view.bundle(outcome)
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"] == text_view.render(outcome)


def _bar_lines(fragment: str):
    """``[(style of the line, its tags inside, its text)]`` of each line that holds a
    ``<progress>`` in an HTML fragment."""
    from html.parser import HTMLParser

    lines = []

    class Parser(HTMLParser):
        open_divs = []

        def handle_starttag(self, tag, attrs):
            if tag == "div":
                self.open_divs.append([dict(attrs).get("style", ""), [], []])
            elif self.open_divs:
                self.open_divs[-1][1].append(tag)

        def handle_endtag(self, tag):
            if tag == "div":
                line = self.open_divs.pop()
                if "progress" in line[1]:
                    lines.append((line[0], line[1], "".join(line[2])))

        def handle_data(self, data):
            for line in self.open_divs:
                line[2].append(data)

    Parser().feed(fragment)
    return lines


def test_a_progress_bar_is_one_text_lines_height_in_the_widget_and_the_static_form(
        widget_view):
    """Issue 55: each bar took ~60 px: its own block under a label, tqdm's drawn bar beside
    the progress bar wrapping onto a second line, both at ipywidgets' 28 px a line. Each is
    one line now, of a set height that does not wrap (cut with an ellipsis), whatever the
    frontend's line height; the progress bar draws what tqdm's glyphs drew."""
    import re

    widget_view, handles = widget_view
    view, outcome = widget_view.WidgetView(), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 2)
    for o in range(2):
        outcome.replicas[o].progress["b"] = {
            "n": 5, "total": 10, "desc": f"steps {o}",
            "text": f"steps {o}:  50%|█████     | 5/10 [00:01<00:01,  4.50it/s]"}
    view.tick(outcome)
    forms = {"header": view.header.value, "tab": view._widgets.replicas[0][0].value}
    for o in range(2):
        outcome.replicas[o].state, outcome.replicas[o].elapsed = "done", 1.0
    outcome.elapsed = 1.0
    view.closed(outcome)
    forms["static"] = handles[-1].shown[-1]["text/html"]
    counts = {"header": 2, "tab": 1, "static": 2}
    for form, fragment in forms.items():
        lines = _bar_lines(fragment)
        assert len(lines) == counts[form], (form, fragment)
        for style, inside, text in lines:
            height = int(re.search(r"(?:^|;)height:(\d+)px", style)[1])
            assert 20 <= height <= 24 and f"line-height:{height}px" in style, (form, style)
            assert "white-space:nowrap" in style and "overflow:hidden" in style, style
            assert set(inside) <= {"progress", "span", "b", "code"}, (form, inside)  # inline
            assert "█" not in text and "|" not in text, (form, text)
        if form != "tab":  # (the header's line is its label, bar and count)
            assert lines[0][2].startswith("replica 0: ") or form == "static", lines
    assert "steps 0:  50% 5/10 [00:01<00:01,  4.50it/s]" in _bar_lines(forms["tab"])[0][2]


def test_a_widget_view_that_fails_mid_run_leaves_no_widget_in_its_display(widget_view,
                                                                          monkeypatch):
    """The text view takes over; the failed view's live display says so at once, naming no
    widget (saved so, it would be "Error displaying widget" once the kernel is gone)."""
    widget_view, handles = widget_view
    inner = widget_view.WidgetView()
    view, outcome = views.FallbackView(inner, out=io.StringIO()), RunOutcome("CPU")
    view.opened(outcome)
    _start(view, outcome, 2)
    view.tick(outcome)  # (drawn: its live display)
    assert WIDGET_VIEW in handles[-1].shown[-1]
    monkeypatch.setattr(inner, "_draw_header", lambda outcome: 1 / 0)
    view.tick(outcome)
    assert view.failed.startswith("ZeroDivisionError")
    assert handles[-1].shown[-1] == {"text/plain": widget_view.ABANDONED_TEXT}
    assert inner.box is None


def test_the_full_logs_are_pointed_at_only_where_a_replicas_output_was_cut(
        widget_view, private_state):
    """Every cell that printed said "full logs: ..." (in the header and its summary): a line
    a person learns to skip. Only a run whose output is longer than the views show needs it.
    The header names the failed as "replicas 0-1", not "replica 0-1"."""
    from colab_xla.notebook import state
    from colab_xla.notebook.output_log import TAIL_LINES as OUTPUT_TAIL

    widget_view, _ = widget_view
    for lines, cut in ((3, False), (OUTPUT_TAIL + 100, True)):
        view, outcome = widget_view.WidgetView(), RunOutcome("CPU", log_dir=state.next_log_dir())
        view.opened(outcome)
        _start(view, outcome, 2, line="")
        for o in range(2):
            outcome.replicas[o].log.write("stdout", "".join(f"{n}\n" for n in range(lines)))
            view.output(outcome, o, ["0"])
            rep = outcome.replicas[o]
            rep.state, rep.elapsed = "failed", 0.5
        outcome.elapsed = 0.6
        view.tick(outcome)
        assert outcome.logged
        assert ("full logs" in view.header.value) == cut, view.header.value
        assert "failed: replicas 0-1" in view.header.value, view.header.value
        assert ("full logs" in html_view.render(outcome)) == cut
        assert ("full logs" in text_view.render(outcome)) == cut
        view.closed(outcome)
