"""The live widget: a header and one tab per replica, plus a combined tab.

Core ipywidgets only (HTML, Output, Tab, VBox), so Colab's widget manager renders it.
Every update is a trait assignment made in the thread that runs the cell, at most once
per tick: never ``with output:`` from another thread (ipywidgets#2358, #4020), and never
``append_stdout`` per line (it re-sends every output each call).

When the run ends, the display is replaced by a bundle of the widget, a text/plain and a
text/html summary, so a saved notebook shows per-replica results without widget state.
"""

from __future__ import annotations

import collections
import html
import time
from typing import Deque, Dict, List, Tuple

import ipywidgets as widgets
from IPython.display import display

from . import html_view, text_view
from .outcome import RunOutcome, format_ordinals
from .run import RunObserver

COMBINED_LINES = 400
# Look back this far for the same line from other replicas (merged into one row).
_MERGE_WINDOW = 64


class WidgetView(RunObserver):
    def __init__(self):
        self.header = widgets.HTML()
        self.combined = widgets.Output()
        self.tabs = widgets.Tab(children=[self.combined])
        self.box = widgets.VBox([self.header, self.tabs])
        self._replicas: Dict[int, Tuple[widgets.HTML, widgets.Output, widgets.HTML]] = {}
        self._drawn: Dict[int, tuple] = {}
        self._lines: Deque[list] = collections.deque(maxlen=COMBINED_LINES)  # [text, {sources}]
        self._combined_dirty = False
        self._started = time.monotonic()
        self._handle = None

    # -- RunObserver ------------------------------------------------------------------------

    def opened(self, outcome: RunOutcome) -> None:
        self._started = time.monotonic()
        self._draw_header(outcome)
        self._handle = display(self.box, display_id=True)

    def started(self, outcome: RunOutcome, ordinal: int) -> None:
        self._ensure_tab(ordinal)

    def output(self, outcome: RunOutcome, source, lines: List[str]) -> None:
        recent = list(self._lines)[-_MERGE_WINDOW:]
        for line in lines:
            for entry in reversed(recent):
                if entry[0] == line and source not in entry[1]:
                    entry[1].add(source)
                    break
            else:
                entry = [line, {source}]
                self._lines.append(entry)
                recent.append(entry)
        self._combined_dirty = True

    def tick(self, outcome: RunOutcome) -> None:
        self._draw_header(outcome)
        for ordinal in sorted(outcome.replicas):
            self._draw_replica(outcome, ordinal)
        if self._combined_dirty:
            self.combined.outputs = (_stream("\n".join(self._combined_rows(outcome)) + "\n"),)
            self._combined_dirty = False
        self._draw_titles(outcome)

    def closed(self, outcome: RunOutcome) -> None:
        self.tick(outcome)
        if self._handle is None:
            return
        self._handle.update({**widget_bundle(self.box),
                             "text/plain": text_view.render(outcome),
                             "text/html": html_view.render(outcome)}, raw=True)

    # -- drawing ----------------------------------------------------------------------------

    def _ensure_tab(self, ordinal: int):
        if ordinal not in self._replicas:
            # Its state, then its output, then its error: the order things happened.
            self._replicas[ordinal] = (widgets.HTML(), widgets.Output(), widgets.HTML())
            ordered = sorted(self._replicas)
            self.tabs.children = [self.combined] + [
                widgets.VBox(list(self._replicas[o])) for o in ordered]
        return self._replicas[ordinal]

    def _draw_header(self, outcome: RunOutcome) -> None:
        elapsed = outcome.elapsed if outcome.elapsed is not None else time.monotonic() - self._started
        state = ("interrupted" if outcome.interrupted else
                 "running" if outcome.elapsed is None else
                 "failed" if not outcome.ok else "done")
        failed = "".join(
            f" · <span style='color:#cf222e'>{what}: replica {format_ordinals(ordinals)}</span>"
            for what, ordinals in (("failed", outcome.failed), ("stopped", outcome.killed))
            if ordinals)
        counts = text_view.headline(outcome).split(": ", 1)[-1].split(" in ")[0]
        logs = (f"<br><span style='font-size:smaller'>full logs: <code>"
                f"{html.escape(outcome.log_dir)}</code></span>" if outcome.log_dir else "")
        self.header.value = (f"<b>{outcome.device_type}</b> · {len(outcome.replicas)} replicas · "
                             f"<b>{state}</b> · {elapsed:.1f} s · {html.escape(counts)}"
                             f"{failed}{logs}")

    def _draw_replica(self, outcome: RunOutcome, ordinal: int) -> None:
        rep = outcome.replicas[ordinal]
        status, out, error = self._ensure_tab(ordinal)
        key = (rep.state, rep.log.version, rep.elapsed is not None)
        if self._drawn.get(ordinal) == key and rep.elapsed is not None:
            return
        took = rep.elapsed if rep.elapsed is not None else time.monotonic() - self._started
        result = ""
        if rep.value_repr is not None and rep.error is None:
            result = f" · Out: <code>{html.escape(rep.value_repr)}</code>"
        if rep.pulled:
            result += f" · Pulled: <code>{html.escape(rep.pulled_summary())}</code>"
        status.value = f"replica {ordinal} · <b>{rep.state}</b> · {took:.1f} s{result}"
        if rep.error is not None:
            error.value = (f"<pre style='color:#cf222e;white-space:pre-wrap'>"
                           f"{html.escape(rep.error.render())}</pre>")
        if self._drawn.get(ordinal, (None, None))[1] != rep.log.version:
            out.outputs = _log_outputs(rep.log)
        self._drawn[ordinal] = key

    def _draw_titles(self, outcome: RunOutcome) -> None:
        titles = ["all"] + [f"{o} {html_view.state_mark(outcome.replicas[o].state)}"
                            for o in sorted(self._replicas)]
        if hasattr(self.tabs, "titles"):  # ipywidgets 8
            if tuple(self.tabs.titles) != tuple(titles):
                self.tabs.titles = tuple(titles)
        else:  # ipywidgets 7 (Colab)
            for i, title in enumerate(titles):
                self.tabs.set_title(i, title)

    def _combined_rows(self, outcome: RunOutcome) -> List[str]:
        n = len(outcome.replicas)
        rows = []
        for text, sources in self._lines:
            ordinals = [s for s in sources if isinstance(s, int)]
            if len(sources) > 1 and len(ordinals) == len(sources):
                label = (f"all {n}" if len(ordinals) == n and n > 1
                         else f"replicas {format_ordinals(ordinals)}")
            else:
                label = " ".join(f"replica {s}" if isinstance(s, int) else str(s)
                                 for s in sorted(sources, key=str))
            rows.append(f"[{label}] {text}")
        return rows


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
    """The log's tail as stream outputs, stderr apart so the frontend shows it as such."""
    runs: List[dict] = []
    for stream, line in list(log.tail) + log.partial():
        if runs and runs[-1]["name"] == stream:
            runs[-1]["text"] += line + "\n"
        else:
            runs.append(_stream(line + "\n", stream))
    if log.truncated:
        runs.insert(0, _stream(log.earlier_note() + "\n"))
    return tuple(runs)
