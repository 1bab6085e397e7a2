"""The live widget: a header and one tab per replica, plus a combined tab, while a run runs.

Core ipywidgets only (HTML, Output, Tab, VBox), so Colab's widget manager renders it.
Every update is a trait assignment made in the thread that runs the cell, at most once
per tick: never ``with output:`` from another thread (ipywidgets#2358, #4020), and never
``append_stdout`` per line (it re-sends every output each call).

The widget is made and displayed once it is drawn: at the run's first draw (at once when
output comes, else a quarter second in: ``TICK_SECONDS``). When the run ends, its display is
updated to the run's static form (:func:`colab_xla.notebook.views.html.bundle`: HTML with a
section per replica, and the text form), with no widget in it: what stays in the notebook
reads without the kernel, its widget models or any script (a bundle that still names a
widget is drawn as that widget, an error once its model is gone), and a frontend that never
drew the widget ends with the results shown too. A run that ends before its first draw is
only that static form, displayed once. The ended run's widgets are then made over for the
next run (:data:`SPARE_RUNS` runs' at most) or closed, so the kernel keeps one run's widgets,
and a cell does not wait for comm messages that open widgets and close them again.
"""

from __future__ import annotations

import collections
import contextlib
import html
import itertools
import time
from typing import Deque, Dict, List, Optional, Tuple

import ipywidgets as widgets
from IPython.display import display

from . import html as html_view, text as text_view
from ..outcome import RunObserver, RunOutcome, Stall, counted, format_ordinals
from ...wire.displays import Display
from ..output_log import BarLine, shorten

COMBINED_LINES = 400
# Look back this far for the same line from other replicas (merged into one row).
_MERGE_WINDOW = 64
# Lines that came since the last draw and wait for it: the read loop only appends them
# (output() costs nothing per line, so the view never slows the reading of replicas, nor
# them), the draw merges them into rows. Enough for the combined tab's rows when up to 8
# replicas print the same lines; a flood beyond that leaves a row saying how many lines the
# tab skipped (each replica's tab has its own latest lines, the logs all of them).
PENDING_LINES = COMBINED_LINES * 8 + _MERGE_WINDOW
# Ended runs whose widgets wait to be made over for the next run, instead of closed. A run
# has 6 widgets plus 3 per replica (4 for a replica that failed): every widget of a run
# shares one layout and its HTML widgets one style (made per widget, they were most of a
# run's widgets, and each is a comm message that a short cell's launch waits for).
SPARE_RUNS = 1
# What the live display says where widgets cannot show (the run's static form replaces it).
LIVE_TEXT = ("colab_xla: the run's live view (a widget); its static form replaces this at "
             "the end.")
# What an abandoned live display becomes: its view failed (the text view took over) or its
# run raised before its end was drawn.
ABANDONED_TEXT = "colab_xla: this run's live view stopped; the run is shown as text below it."
# How often the output of a replica whose tab is not the one shown is sent again while the
# run goes on (the shown tab's: at every draw). Each send is the tab's last lines, whole:
# under heavy output, the sends of every hidden tab at each draw took the kernel's CPU
# from the replicas. Its state and mark are drawn at every draw; the last draw sends all.
HIDDEN_OUTPUT_SECONDS = 2.0
# The views that took widgets and have not ended: at most the one drawing now, and one whose
# end never came (retired when the next run takes its widgets).
_live: Deque["WidgetView"] = collections.deque()
_spare: Deque["_RunWidgets"] = collections.deque()


class _RunWidgets:
    """One run's widgets: a header over a Tab of a combined tab and a tab per replica (its
    state, and its output), sharing one layout and one style. Made anew, or a retired run's
    made over (:meth:`cleared`): a comm message per widget opened and closed is most of what
    a short cell's widget view costs."""

    def __init__(self):
        self.layout = widgets.Layout()
        self.style = widgets.HTML.class_traits()["style"].klass()
        self.header = self.html()
        self.combined = widgets.Output(layout=self.layout)
        self.tabs = widgets.Tab(children=[self.combined], layout=self.layout)
        self.box = widgets.VBox([self.header, self.tabs], layout=self.layout)
        # By ordinal: a replica's state, output and page (its tab).
        self.replicas: Dict[int, Tuple[widgets.HTML, widgets.Output, widgets.VBox]] = {}

    def html(self, value: str = "") -> widgets.HTML:
        return widgets.HTML(value=value, layout=self.layout, style=self.style)

    def replica(self, ordinal: int, status: str) -> Tuple[widgets.HTML, widgets.Output,
                                                          widgets.VBox]:
        """Replica ``ordinal``'s state, output and page (its tab), showing ``status`` and no
        output: made over if these widgets have them from an earlier run, else made."""
        if ordinal in self.replicas:
            state, out, page = self.replicas[ordinal]
            state.value, out.outputs = status, ()  # (a message only where they change)
        else:
            state, out = self.html(status), widgets.Output(layout=self.layout)
            page = widgets.VBox([state, out], layout=self.layout)
            self.replicas[ordinal] = state, out, page
        return state, out, page

    def cleared(self) -> "_RunWidgets":
        """These widgets, for a new run: no lines in the combined tab, which is the one
        shown (the last run's person may have left it on a replica's tab, which in this
        run may be another replica's, or none). Their header, tabs and titles are the last
        run's until the new run's first draw, which comes before they are displayed: drawn
        over, only what changes is sent (a run of as many replicas as the last sends no tab
        or title), and a replica's widgets show its new state and output as its tab comes
        back."""
        self.combined.outputs = ()
        self.tabs.selected_index = 0
        return self

    def all(self) -> List[widgets.Widget]:
        return [self.layout, self.style, self.header, self.combined, self.tabs, self.box,
                *(w for replica in self.replicas.values() for w in replica)]


class WidgetView(RunObserver):
    def __init__(self):
        # The widgets are made when the run opens: a run that never starts (a bad option)
        # must not leave widgets behind.
        self.box: Optional[widgets.VBox] = None
        self._widgets: Optional[_RunWidgets] = None
        self._shown: List[int] = []  # the replicas that have their tab, in order
        self._errors: Dict[int, widgets.HTML] = {}  # made when a replica fails
        self._titles: Tuple[str, ...] = ()
        self._before: Optional[set] = None  # the widgets that existed when the run opened
        self._made: List[widgets.Widget] = []
        self._drawn: Dict[int, tuple] = {}
        self._lines: Deque[list] = collections.deque(maxlen=COMBINED_LINES)  # [text, {sources}]
        self._pending: Deque[tuple] = collections.deque(maxlen=PENDING_LINES)  # (origin, line)
        self._skipped = 0  # lines that left _pending undrawn (a flood between two draws)
        self._started = time.monotonic()
        self._opened = False
        self._handle = None
        self._stall: Optional[str] = None  # where the replicas are, while none prints
        self._output_sent: Dict[int, float] = {}  # replica -> when its output was last sent

    # -- RunObserver ------------------------------------------------------------------------

    def opened(self, outcome: RunOutcome) -> None:
        self._opened = True
        self._started = time.monotonic()
        # Its widgets come at the first draw (tick), and are displayed once drawn: a run
        # that ends before with nothing to show live has none (see closed).

    def _take_widgets(self) -> None:
        """This run's widgets, at its first draw: an ended run's made over, or new ones. A
        run whose end never came is retired first."""
        while _live:
            _live.popleft().retire()
        self._before = set(_registry())
        self._widgets = _spare.popleft().cleared() if _spare else _RunWidgets()
        self.header, self.combined = self._widgets.header, self._widgets.combined
        self.tabs, self.box = self._widgets.tabs, self._widgets.box
        _live.append(self)

    # A replica's tab is made at the next tick (see _ensure_tabs), with those of the other
    # replicas that started by then: one change of the Tab's children, not one per replica.

    def output(self, outcome: RunOutcome, origin, lines: List[str]) -> None:
        # Called by the read loop for every piece of output: only kept for the next draw.
        self._skipped += max(0, len(self._pending) + len(lines) - PENDING_LINES)
        self._pending.extend(zip(itertools.repeat(origin), lines))

    def _merge_pending(self) -> None:
        """The lines that came since the last draw, as the combined tab's rows: a line that
        another replica printed among the last :data:`_MERGE_WINDOW` rows joins that row."""
        if not self._pending:
            return
        if self._skipped:
            self._lines.append([f"... {self._skipped} lines not shown here (each replica's "
                                "tab has its latest lines, its log all of them)", None])
            self._skipped = 0
        recent: Deque[list] = collections.deque(
            itertools.islice(reversed(self._lines), _MERGE_WINDOW), maxlen=_MERGE_WINDOW)
        recent.reverse()
        for origin, line in self._pending:
            line = line if _drawn(line) else shorten(line)
            for entry in reversed(recent):
                if (entry[1] is not None and origin not in entry[1]
                        and _same_output(entry[0], line)):
                    entry[1].add(origin)
                    break
            else:
                entry = [line, {origin}]
                self._lines.append(entry)
                recent.append(entry)
        self._pending.clear()

    def tick(self, outcome: RunOutcome) -> None:
        if self._widgets is None:
            self._take_widgets()
        self._draw_header(outcome)
        self._ensure_tabs(outcome)
        shown = self._shown_replica()
        now = time.monotonic()
        for ordinal in sorted(outcome.replicas):
            self._draw_replica(outcome, ordinal, outcome.elapsed is not None
                               or ordinal == shown
                               or now - self._output_sent.get(ordinal, 0.0)
                               >= HIDDEN_OUTPUT_SECONDS)
        if self._pending:  # (_combined_rows merges them)
            self.combined.outputs = _combined_outputs(self._combined_rows(outcome))
        self._draw_titles(outcome)
        if self._handle is None and outcome.elapsed is None:
            self._display({"text/plain": LIVE_TEXT})

    def stalled(self, outcome: RunOutcome, stall: Optional[Stall]) -> None:
        self._stall = stall.notice(outcome) if stall else None  # (drawn at the next tick)

    def closed(self, outcome: RunOutcome) -> None:
        if not self._opened:
            return  # (never opened, or closed already)
        self._opened = False
        self._stall = None
        # Every widget made in this thread since the run opened is this view's, also one
        # an Interrupt cut off halfway through making (registered, never in the tree).
        if self._before is not None:
            self._made = [w for model_id, w in list(_registry().items())
                          if model_id not in self._before]
        static = html_view.bundle(outcome)
        if self._handle is None:
            # Ended before its first draw: its static form is all it shows (no widget made
            # or made over: most of a warm cell's cost in the widget view).
            display(static, raw=True)
        else:
            # The live display becomes the static form, so the widget is not drawn again
            # at the end, and its widgets are free for the next run at once.
            self._handle.update(static, raw=True)
        self._release(spare=self._handle is not None)

    def _display(self, fallback: dict) -> None:
        # The display data, not the widget: IPython 7 (Colab) hands a widget to its own
        # _ipython_display_, which drops display_id, and the closing update would match
        # no display (the saved cell would keep the widget's repr, not the summary).
        self._handle = display({**widget_bundle(self.box), **fallback}, raw=True,
                               display_id=True)

    def retire(self) -> None:
        """End a live display whose run's end never came (its view failed, or the run
        raised): the display says so, with no widget in it, and the widgets are closed."""
        if self._handle is not None:
            with contextlib.suppress(Exception):  # a gone frontend: close them anyway
                self._handle.update({"text/plain": ABANDONED_TEXT}, raw=True)
        self._release(spare=False)

    def _release(self, spare: bool) -> None:
        """Keep this run's widgets for the next run to make over if ``spare`` and no other
        run's are kept (:data:`SPARE_RUNS`); close the others (their layouts and styles too,
        and the tabs of an earlier, larger run that this one did not show): the kernel and
        the frontend drop them. Its error widgets are closed either way."""
        with contextlib.suppress(ValueError):
            _live.remove(self)
        if self._widgets is None:
            return
        kept: List[widgets.Widget] = []
        if spare and len(_spare) < SPARE_RUNS:
            for ordinal in self._errors:  # (its error widget is closed below)
                state, out, page = self._widgets.replicas[ordinal]
                page.children = (state, out)
            kept = self._widgets.all()
            _spare.append(self._widgets)
        kept_ids = {id(w) for w in kept}
        mine = self._made + list(self._errors.values()) + self._widgets.all()
        for widget in {id(w): w for w in mine}.values():
            if id(widget) not in kept_ids:
                with contextlib.suppress(Exception):
                    widget.close()
        self._made = []
        self.box = self._handle = self._widgets = None  # (its widgets may be another run's)
        self.header = self.combined = self.tabs = None
        self._shown, self._errors = [], {}

    # -- drawing ----------------------------------------------------------------------------

    def _ensure_tabs(self, outcome: RunOutcome) -> None:
        new = [o for o in sorted(outcome.replicas) if o not in self._shown]
        for ordinal in new:
            # Its state, then its output (then its error, if it fails): the order things
            # happened.
            self._widgets.replica(ordinal, self._status(outcome, ordinal))
        if new:
            self._shown = sorted(self._shown + new)
            self.tabs.children = [self.combined] + [self._widgets.replicas[o][2]
                                                    for o in self._shown]

    def _show_error(self, ordinal: int, value: str) -> None:
        error = self._errors.get(ordinal)
        if error is None:
            error = self._errors[ordinal] = self._widgets.html(value)
            page = self._widgets.replicas[ordinal][2]
            page.children = tuple(page.children) + (error,)
        else:
            error.value = value

    def _draw_header(self, outcome: RunOutcome) -> None:
        elapsed = (outcome.elapsed if outcome.elapsed is not None  # (start-up included)
                   else time.monotonic() - outcome.began)
        state = ("interrupted" if outcome.interrupted else
                 "running" if outcome.elapsed is None else
                 "failed" if not outcome.ok else "done")
        failed = "".join(
            f" · <span style='color:#cf222e'>{what}: replica{'s' if len(ordinals) > 1 else ''} "
            f"{format_ordinals(ordinals)}</span>"
            for what, ordinals in (("failed", outcome.failed), ("stopped", outcome.stopped))
            if ordinals)
        counts = text_view.states(outcome)
        logs = (f"<br><span style='font-size:smaller'>full logs: <code>"
                f"{html.escape(outcome.log_dir)}</code></span>" if outcome.cut else "")
        replicas = counted(len(outcome.replicas), "replica")
        # Where they are while none prints; once the run is cut, where the stopped were.
        where = self._stall or "\n".join(outcome.places(outcome.stopped))
        # While bars run: one line per replica, its first bar (each tab has all of them).
        bars = "".join(
            f"<div style='font-size:smaller'>"
            f"{html_view.bar(bar, compact=True, label=f'{outcome.label(o)}: ')}</div>"
            for o, rep in outcome.replicas.items()
            for bar in [b for b in rep.progress.values() if not b.get("closed")][:1])
        stall = (f"<pre style='color:#9a6700;white-space:pre-wrap;margin:4px 0'>"
                 f"{html.escape(where)}</pre>" if where else "")
        self.header.value = (f"<b>{outcome.device_type}</b> · {replicas} · "
                             f"<b>{state}</b> · {elapsed:.1f} s · {html.escape(counts)}"
                             f"{failed}{logs}{bars}{stall}")

    def _shown_replica(self) -> Optional[int]:
        """The replica whose tab the person looks at (None: the combined tab)."""
        index = self.tabs.selected_index
        return self._shown[index - 1] if index and 0 < index <= len(self._shown) else None

    def _draw_replica(self, outcome: RunOutcome, ordinal: int, output: bool = True) -> None:
        """Replica ``ordinal``'s tab: its state always, its output if ``output``."""
        rep = outcome.replicas[ordinal]
        status, out, _ = self._widgets.replicas[ordinal]
        drawn = self._drawn.get(ordinal, (None, None, None, None))
        version = rep.log.version if output else drawn[1]
        key = (rep.state, version, rep.elapsed is not None, rep.progress_changes)
        if drawn == key and rep.elapsed is not None:
            return
        status.value = self._status(outcome, ordinal)
        if rep.error is not None:
            self._show_error(ordinal, f"<pre style='color:#cf222e;white-space:pre-wrap'>"
                                      f"{html.escape(rep.error.render())}</pre>")
        if output and drawn[1] != rep.log.version:
            out.outputs = _log_outputs(rep.log)
            self._output_sent[ordinal] = time.monotonic()
        self._drawn[ordinal] = key

    def _status(self, outcome: RunOutcome, ordinal: int) -> str:
        rep = outcome.replicas[ordinal]
        took = rep.elapsed if rep.elapsed is not None else time.monotonic() - self._started
        result = ""
        if rep.value_repr is not None and rep.error is None:
            result = f" · Out: <code>{html.escape(rep.value_repr)}</code>"
        if rep.pulled:
            result += f" · Pulled: <code>{html.escape(rep.pulled_summary())}</code>"
        bars = "".join(html_view.bar(bar) for bar in rep.progress.values())
        return (f"{html.escape(outcome.label(ordinal))} · <b>{rep.state}</b> · {took:.1f} s"
                f"{result}{bars}")

    def _draw_titles(self, outcome: RunOutcome) -> None:
        titles = ["all"] + [f"{o} {html_view.state_mark(outcome.replicas[o].state)}"
                            for o in self._shown]
        if tuple(titles) == self._titles:
            return
        self._titles = tuple(titles)
        if hasattr(self.tabs, "titles"):  # ipywidgets 8
            self.tabs.titles = tuple(titles)
        else:  # ipywidgets 7 (Colab): set_title sends the whole dict at each call
            self.tabs._titles = {str(i): title for i, title in enumerate(titles)}

    def _combined_rows(self, outcome: RunOutcome) -> List[str]:
        """The combined tab's rows: each line once, after the replicas that printed it
        (``[all 4]``, ``[replicas 0-1]``, ``[replica 2]``). A displayed object's row is a
        :class:`~colab_xla.wire.displays.Display` (drawn under it): one row for the
        replicas that showed the same one, a row each for different ones (their text forms,
        an image's ``[an image: image/png]``, may be alike)."""
        self._merge_pending()
        n = len(outcome.replicas)
        rows = []
        for text, sources in self._lines:
            if sources is None:  # the note of a flood's skipped lines
                rows.append(text)
                continue
            ordinals = [s for s in sources if isinstance(s, int)]
            if len(sources) > 1 and len(ordinals) == len(sources):
                label = (f"all {n}" if len(ordinals) == n and n > 1
                         else f"replicas {format_ordinals(ordinals)}")
            else:
                label = " ".join(outcome.label(s) if isinstance(s, int) else str(s)
                                 for s in sorted(sources, key=str))
            row = f"[{label}] {text}"
            if _drawn(text):
                row = Display(row)
                row.bundle = text.bundle
            rows.append(row)
        return rows


def _drawn(line) -> bool:
    """Whether ``line`` is a displayed object the widget draws."""
    return isinstance(line, Display) and line.drawn


def _same_output(kept, line) -> bool:
    """Whether ``line`` is the output a combined row ``kept`` shows: the same text, and for
    a displayed object, the same object (its bundle: the image itself, not its text form)."""
    if kept != line:
        return False
    if _drawn(kept) or _drawn(line):
        return getattr(kept, "bundle", None) == getattr(line, "bundle", None)
    return True


def _combined_outputs(rows: List[str]) -> tuple:
    """The combined tab's rows as outputs: text in stream outputs, each displayed object
    drawn under its row."""
    outputs: List[dict] = []
    text: List[str] = []
    for row in rows:
        text.append(row)
        if _drawn(row):
            outputs.append(_stream("\n".join(text) + "\n"))
            outputs.append({"output_type": "display_data", "data": row.bundle, "metadata": {}})
            text = []
    if text:
        outputs.append(_stream("\n".join(text) + "\n"))
    return tuple(outputs)


def _registry() -> dict:
    """ipywidgets' own model id -> widget map of every open widget: the module's
    ``_instances`` on ipywidgets 8.1 (its Widget attributes are deprecated), else
    ``Widget.widgets`` (7)."""
    from ipywidgets.widgets import widget as widget_module

    found = getattr(widget_module, "_instances", None)
    return found if found is not None else widgets.Widget.widgets


def widget_bundle(widget: widgets.Widget) -> dict:
    """The display data that shows ``widget``, on ipywidgets 7 (Colab) and 8 alike.

    ipywidgets 8 has ``_repr_mimebundle_``; 7 displays through ``_ipython_display_`` and has
    none. Both speak version 2 of the widget protocol, so the data is built here.
    """
    return {"application/vnd.jupyter.widget-view+json":
            {"version_major": 2, "version_minor": 0, "model_id": widget.model_id}}


def _stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def _log_outputs(log) -> tuple:
    """The log's tail as stream outputs, stderr apart so the frontend shows it as such,
    and what the replica displayed as display data, in their order. A left bar's last line
    is not among them: the tab's state draws the bar, that line with it."""
    runs: List[dict] = []
    for stream, line in list(log.tail) + log.partial():
        if isinstance(line, BarLine):
            continue
        if isinstance(line, Display) and line.drawn:
            runs.append({"output_type": "display_data", "data": line.bundle, "metadata": {}})
            continue
        line = shorten(line)
        if runs and runs[-1].get("name") == stream:
            runs[-1]["text"] += line + "\n"
        else:
            runs.append(_stream(line + "\n", stream))
    if log.truncated:
        runs.insert(0, _stream(log.earlier_note() + "\n"))
    return tuple(runs)
