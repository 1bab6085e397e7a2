"""The outcome of a run as static HTML: what a saved notebook, nbconvert or GitHub shows
where the widget cannot render. Same content as :mod:`colab_xla.notebook.views.text`."""

from __future__ import annotations

import html

from . import text as text_view
from ...wire.displays import Display
from ..outcome import DONE, FAILED, STOPPED, RunOutcome, format_ordinals

MARKS = {DONE: "✓", FAILED: "✗", STOPPED: "■"}
_COLORS = {DONE: "#1a7f37", FAILED: "#cf222e", STOPPED: "#9a6700"}
# Inline styles: notebook renderers (nbconvert, GitHub) bring their own table CSS.
_PRE = "margin:0;font-family:monospace;text-align:left;white-space:pre-wrap"
_TD = "text-align:left;vertical-align:top"


def state_mark(state: str) -> str:
    """One glyph per replica state (running: ▶), shared by the widget's tab titles."""
    return MARKS.get(state, "▶")


def render(outcome: RunOutcome, tail: int = text_view.SUMMARY_TAIL) -> str:
    esc = html.escape
    rows = []
    for ordinal in sorted(outcome.replicas):
        rep = outcome.replicas[ordinal]
        color = _COLORS.get(rep.state, "inherit")
        took = f"{rep.elapsed:.2f} s" if rep.elapsed is not None else ""
        if rep.error is not None:
            error = esc(text_view.error_line(rep.error))
            result = f'<span style="color:{_COLORS[FAILED]}">{error}</span>'
        else:
            result = f"<code>{esc(rep.value_repr)}</code>" if rep.value_repr is not None else ""
            if rep.pulled:
                result += f" Pulled: <code>{esc(rep.pulled_summary())}</code>"
        output = _output(text_view.tail_lines(rep.log, tail))
        rows.append(f"<tr><td style='{_TD}'>{esc(_ordinal(outcome, ordinal))}</td>"
                    f"<td style='{_TD};color:{color}'>"
                    f"{state_mark(rep.state)} {esc(rep.state)}</td><td style='{_TD}'>{took}</td>"
                    f"<td style='{_TD}'>{result}</td><td style='{_TD}'>{output}</td></tr>")
    details = "".join(
        f"<details open><summary>{esc(error.ename)} on replica{'s' if len(o) > 1 else ''} "
        f"{format_ordinals(o)}</summary><pre style='{_PRE}'>"
        f"{esc(chr(10).join([error.render(), *outcome.places(o)]))}</pre></details>"
        for error, o in outcome.error_groups())
    for label, log in sorted(outcome.processes.items()):
        lines = text_view.tail_lines(log, tail)
        rows.append(f"<tr><td colspan='4' style='{_TD}'>{esc(label)} (not tied to one replica)"
                    f"</td><td style='{_TD}'><pre style='{_PRE}'>{esc(chr(10).join(lines))}</pre>"
                    "</td></tr>")
    logs = f"<p style='font-size:smaller'>full logs: <code>{esc(outcome.log_dir)}</code></p>" \
        if outcome.logged else ""
    return (f"<div class='colab-xla-summary'><p><b>{esc(text_view.headline(outcome))}</b></p>"
            "<table><tr>" + "".join(f"<th style='{_TD}'>{h}</th>" for h in (
                "replica", "state", "time", "result", "output (last lines)")) + "</tr>"
            f"{''.join(rows)}</table>{details}{logs}</div>")


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
    bundle = shown.bundle
    for mime in ("image/png", "image/jpeg", "image/gif"):
        if isinstance(bundle.get(mime), str):
            return (f"<img src='data:{mime};base64,{bundle[mime].strip()}' "
                    "style='max-width:100%'/>")
    for mime in ("image/svg+xml", "text/html"):  # (the replica's own, as a notebook shows it)
        if isinstance(bundle.get(mime), str):
            return f"<div>{bundle[mime]}</div>"
    return None


def _ordinal(outcome: RunOutcome, ordinal: int) -> str:
    """The replica column: the ordinal, with its host on a cluster."""
    return outcome.label(ordinal) if ordinal in outcome.hosts else str(ordinal)
