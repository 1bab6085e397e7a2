"""The outcome of a run as static HTML: what stays in the notebook once a run ends.

The widget view's end is this (with the text form of :mod:`colab_xla.notebook.views.text`
beside it): readable without the kernel, its widget models or any JavaScript, so JupyterLab
and the Notebook reopening it, nbconvert, GitHub, nbviewer, VS Code and Colab's output frame
all show it. A headline (and, for a run that was cut, where the stopped replicas were), then
a section per replica, failed ones first and open (a ``<details>``, which needs no script to
open and close): its state, time and result or error line, then its output's last lines
with what it displayed (pictures, HTML) in their order, its bars, its result and its whole
error with where it was.

Only what the HTML sanitizers of JupyterLab and the Notebook keep in an untrusted notebook:
tags such as ``<details>``, ``<pre>``, ``<img>`` with a data URI and ``<progress>``, inline
styles of common properties, no script, no ``<style>``, no ``id``. (nbconvert's
``sanitize_html``, off by default, keeps none of ``<details>``, ``<p>``, ``<img>``.) Every
piece of text a replica or the cell made is escaped; what a replica displayed as HTML or SVG
is drawn as a notebook draws a cell's own display (a sanitizer cleans it where the notebook
is not trusted).

Example::

    >>> from colab_xla.notebook.outcome import RunOutcome, ReplicaOutcome
    >>> o = RunOutcome("CPU", {0: ReplicaOutcome(0, "done", elapsed=0.5, value_repr="<1>")})
    >>> "<code>&lt;1&gt;</code>" in render(o)
    True
"""

from __future__ import annotations

import html
import re
from typing import List, Optional

from . import text as text_view
from ...wire.displays import Display
from ..outcome import (DONE, FAILED, STOPPED, ReplicaOutcome, RunOutcome, format_ordinals,
                       fraction)

MARKS = {DONE: "✓", FAILED: "✗", STOPPED: "■"}
COLORS = {DONE: "#1a7f37", FAILED: "#cf222e", STOPPED: "#9a6700"}
# Inline styles: notebook renderers (nbconvert, GitHub) bring their own table CSS, and an
# untrusted notebook keeps no <style> block.
_PRE = "margin:2px 0;font-family:monospace;text-align:left;white-space:pre-wrap"
_SECTION = "margin:2px 0"
_BODY = "margin:0 0 6px 1.2em"
# The class names tests and people's own CSS can find the parts by (sanitizers keep class).
SUMMARY_CLASS = "colab-xla-summary"
REPLICA_CLASS = "colab-xla-replica"
# Which replicas come first: failed, then stopped, then the rest (each by ordinal).
_ORDER = {FAILED: 0, STOPPED: 1}


def state_mark(state: str) -> str:
    """One glyph per replica state (running: ▶), shared by the widget's tab titles."""
    return MARKS.get(state, "▶")


def bundle(outcome: RunOutcome) -> dict:
    """The display data of a run's end: its static HTML and its text form, and no widget
    (a frontend draws the richest mime type it has a renderer for: a widget's, without the
    kernel's models, is an error)."""
    return {"text/plain": text_view.render(outcome), "text/html": render(outcome)}


def render(outcome: RunOutcome, tail: Optional[int] = text_view.SUMMARY_TAIL) -> str:
    """The whole run as one HTML fragment; ``tail`` bounds each replica's output lines
    (None: all that are kept)."""
    esc = html.escape
    order = sorted(outcome.replicas,
                   key=lambda o: (_ORDER.get(outcome.replicas[o].state, 2), o))
    parts = [f"<p style='{_SECTION}'><b>{esc(text_view.headline(outcome, values=False))}</b>"
             f"{text_view.values_note(outcome, lambda n: f'<code>{esc(n)}</code>')}"
             f"{_cut(outcome)}</p>"]
    where = outcome.places(outcome.stopped)  # (once the run is cut: those at one place together)
    if where:
        parts.append(f"<pre style='{_PRE};color:{COLORS[STOPPED]}'>"
                     f"{esc(chr(10).join(where))}</pre>")
    if outcome.launch_error is not None:
        parts.append(f"<pre style='{_PRE};color:{COLORS[FAILED]}'>"
                     f"{esc(outcome.launch_error.render())}</pre>")
    opened = [o for o in order if outcome.replicas[o].state in (FAILED, STOPPED)]
    for ordinal in order:
        # The failed and stopped are open; with none, the first replica is.
        is_open = ordinal in opened or (not opened and ordinal == order[0])
        parts.append(_replica(outcome, ordinal, tail, is_open))
    for label, log in sorted(outcome.processes.items()):
        parts.append(f"<details class='{REPLICA_CLASS}' style='{_SECTION}' open><summary>"
                     f"<b>{esc(label)}</b> (output not tied to one replica)</summary>"
                     f"<div style='{_BODY}'>{_output(text_view.tail_lines(log, tail))}"
                     "</div></details>")
    if outcome.cut:
        parts.append(f"<p style='{_SECTION};font-size:smaller'>full logs: "
                     f"<code>{esc(outcome.log_dir)}</code></p>")
    return f"<div class='{SUMMARY_CLASS}'>{''.join(parts)}</div>"


def _cut(outcome: RunOutcome) -> str:
    """The headline's note of the replicas that failed or were stopped."""
    return "".join(
        f" · <span style='color:{COLORS[FAILED]}'>{what}: replica"
        f"{'s' if len(ordinals) > 1 else ''} {html.escape(_ordinals(outcome, ordinals))}</span>"
        for what, ordinals in (("failed", outcome.failed), ("stopped", outcome.stopped))
        if ordinals)


def _ordinals(outcome: RunOutcome, ordinals: List[int]) -> str:
    if any(o in outcome.hosts for o in ordinals):
        return ", ".join(outcome.label(o) for o in ordinals)
    return format_ordinals(ordinals)


def _replica(outcome: RunOutcome, ordinal: int, tail: Optional[int], is_open: bool) -> str:
    """Replica ``ordinal``'s section: a summary line (its label, state, time, and its
    result or error line), then what it printed and displayed, its bars, result, error."""
    esc = html.escape
    rep: ReplicaOutcome = outcome.replicas[ordinal]
    color = COLORS.get(rep.state, "inherit")
    took = f" · {rep.elapsed:.2f} s" if rep.elapsed is not None else ""
    if rep.error is not None:
        gist = (f" · <span style='color:{COLORS[FAILED]}'>"
                f"{esc(text_view.error_line(rep.error))}</span>")
    elif rep.value_repr is not None:
        gist = f" · Out: <code>{esc(_one_line(rep.value_repr))}</code>"
    else:
        gist = ""
    body = [_output(text_view.tail_lines(rep.log, tail))]
    body += [bar(b, compact=b.get("closed")) for b in rep.progress.values()]
    if rep.value_repr is not None and rep.error is None:
        body.append(f"<pre style='{_PRE}'>Out: {esc(rep.value_repr)}</pre>")
    if rep.pulled:
        body.append(f"<pre style='{_PRE}'>Pulled: {esc(rep.pulled_summary())}</pre>")
    if rep.error is not None:
        # (without a traceback, render() says the place itself)
        place = [f"at {rep.error.place}"] if rep.error.place and rep.error.traceback else []
        body.append(f"<pre style='{_PRE};color:{COLORS[FAILED]}'>"
                    f"{esc(chr(10).join([rep.error.render(), *place]))}</pre>")
    return (f"<details class='{REPLICA_CLASS}' style='{_SECTION}'{' open' if is_open else ''}>"
            f"<summary><b>{esc(outcome.label(ordinal))}</b> · <span style='color:{color}'>"
            f"{state_mark(rep.state)} {esc(rep.state)}</span>{took}{gist}</summary>"
            f"<div style='{_BODY}'>{''.join(body)}</div></details>")


def _one_line(text: str, chars: int = 120) -> str:
    """A result's first line, shortened (the section shows it whole)."""
    lines = text.splitlines() or [""]
    return lines[0] if len(lines) == 1 and len(lines[0]) <= chars else lines[0][:chars] + " …"


def bar(progress: dict, compact: bool = False, label: str = "") -> str:
    """A tqdm bar of a replica as one line of HTML, :data:`BAR_LINE` high whatever the
    frontend's own line height (ipywidgets' HTML is 28 px a line): ``label``, a progress
    bar (none without a total), then tqdm's own line without its drawn bar (compact: its
    description and count only), cut with an ellipsis where the line is too narrow."""
    done = fraction(progress)
    meter = (f"<progress value='{done:.3f}' max='1' style='width:{8 if compact else 12}em;"
             f"height:{BAR_LINE - 8}px;margin:0 0.4em 0 0;vertical-align:middle'></progress>"
             if done is not None else "")
    if compact:
        total = f"/{progress['total']}" if progress.get("total") else ""
        text = f"{progress.get('desc') or ''} {progress.get('n') or 0}{total}".strip()
    else:
        text = progress.get("text", "")
        if meter:  # (the progress bar draws it)
            text = _DRAWN_BAR.sub(r"\1 ", text, count=1)
    return (f"<div style='{_BAR_STYLE}'>{html.escape(label)}{meter}"
            f"<span style='font-family:monospace'>{html.escape(text)}</span></div>")


# A bar's line: one text line's height, whatever the frontend's line height, never wrapped.
BAR_LINE = 20
_BAR_STYLE = (f"height:{BAR_LINE}px;line-height:{BAR_LINE}px;margin:0;white-space:nowrap;"
              "overflow:hidden;text-overflow:ellipsis")
# tqdm's own drawn bar in its line: ``50%|█████     | 5/10`` (its l_bar ends with ``%|``).
_DRAWN_BAR = re.compile(r"(\d%)\|[^|]*\| ?")


def _output(lines) -> str:
    """A replica's last lines as HTML: text in ``<pre>`` blocks, what it displayed drawn
    in their order (an image, HTML, SVG; else its text form)."""
    parts, text = [], []
    for line in lines:
        drawn = _drawn(line) if isinstance(line, Display) else None
        if drawn is None:
            text.append(line)
            continue
        if text:
            parts.append(f"<pre style='{_PRE}'>{html.escape(chr(10).join(text))}</pre>")
            text = []
        parts.append(drawn)
    if text:
        parts.append(f"<pre style='{_PRE}'>{html.escape(chr(10).join(text))}</pre>")
    return "".join(parts)


def _drawn(shown: Display):
    """The HTML that draws ``shown``, or None to show its text form."""
    data = shown.bundle
    for mime in ("image/png", "image/jpeg", "image/gif"):
        if isinstance(data.get(mime), str):
            return (f"<img src='data:{mime};base64,{html.escape(data[mime].strip())}' "
                    f"alt='{html.escape(str(shown)[:200])}' style='max-width:100%'/>")
    for mime in ("image/svg+xml", "text/html"):  # (the replica's own, as a notebook shows it)
        if isinstance(data.get(mime), str):
            return f"<div>{data[mime]}</div>"
    return None
