"""Which view shows a run, and the text view taking over when the widget view fails.

A view only draws: whatever goes wrong in it (a frontend's ipywidgets that lacks an API, a
display that raises) must not cost the run its results. :class:`FallbackView` wraps the
chosen view; the first exception from it switches the run to the text view, with one line
saying why, and the text summary at the end shows everything the widget would have. The
caller stores ``-o``/``--pull`` values before it calls :meth:`FallbackView.closed`, so a
view that fails while drawing the end cannot lose them either.

Example::

    >>> class Broken(RunObserver):
    ...     def closed(self, outcome):
    ...         raise AttributeError("no _repr_mimebundle_")
    >>> import io; out = io.StringIO()
    >>> view = FallbackView(Broken(), out=out)
    >>> view.closed(RunOutcome("CPU"))
    >>> first = out.getvalue().splitlines()[0]
    >>> first.startswith("colab_xla: the Broken view failed (AttributeError: no ")
    True
    >>> first.endswith("_repr_mimebundle_); showing this run as text.")
    True
"""

from __future__ import annotations

import contextlib
import sys
from typing import List, Optional

from . import text as text_view
from ..outcome import RunObserver, RunOutcome, Stall

# How much of an exception's message the one line quotes.
_REASON_CHARS = 200


def choose(kind: str, has_kernel: bool) -> RunObserver:
    """The view for a run: ``kind`` is "text", "widget" or "auto" (widget where a Jupyter
    kernel can show it and ipywidgets imports, else text). The widget view comes wrapped
    in a :class:`FallbackView`; the text view is the fallback, so it comes bare."""
    if kind != "text" and has_kernel:
        try:
            from .widget import WidgetView
        except ImportError:  # ipywidgets missing: text still shows everything
            pass
        else:
            return FallbackView(WidgetView())
    return text_view.TextView()


class FallbackView(RunObserver):
    """Forwards every hook to ``view``; if ``view`` raises, the text view takes over.

    The switch is said once (``colab_xla: the widget view failed (...)``), and a failed view
    that has ``retire()`` is retired (the widget view's live display then names no widget,
    which a saved notebook would draw as an error). Output the
    failed view already took is not printed again live; the text summary at the end
    carries each replica's last lines instead. An error of the text view itself is raised.
    """

    def __init__(self, view: RunObserver, out=None):
        self.view = view
        self._out = out
        self._failed: Optional[str] = None

    @property
    def failed(self) -> Optional[str]:
        """Why the first view failed (``"AttributeError: ..."``), or None."""
        return self._failed

    def opened(self, outcome: RunOutcome) -> None:
        self._forward("opened", outcome)

    def started(self, outcome: RunOutcome, ordinal: int) -> None:
        self._forward("started", outcome, ordinal)

    def output(self, outcome: RunOutcome, origin, lines: List[str]) -> None:
        self._forward("output", outcome, origin, lines)

    def finished(self, outcome: RunOutcome, ordinal: int) -> None:
        self._forward("finished", outcome, ordinal)

    def tick(self, outcome: RunOutcome) -> None:
        self._forward("tick", outcome)

    def stalled(self, outcome: RunOutcome, stall: Optional[Stall]) -> None:
        self._forward("stalled", outcome, stall)

    def closed(self, outcome: RunOutcome) -> None:
        self._forward("closed", outcome)

    def _forward(self, hook: str, *args) -> None:
        try:
            getattr(self.view, hook)(*args)
        except Exception as exc:  # noqa: BLE001 - a view must not cost the run its results
            if self._failed is not None or isinstance(self.view, text_view.TextView):
                raise
            self._failed = f"{type(exc).__name__}: {str(exc)[:_REASON_CHARS]}"
            out = self._out or sys.stdout
            print(f"colab_xla: the {_name(self.view)} view failed ({self._failed}); "
                  "showing this run as text.", file=out, flush=True)
            # Its live display, if it has one, no longer names a widget (a saved notebook
            # would draw it as an error), and its widgets go.
            with contextlib.suppress(Exception):
                getattr(self.view, "retire", lambda: None)()
            # Lines already handed to the failed view are not replayed live: the summary
            # at the end shows each replica's last lines in full instead.
            self.view = text_view.TextView(out=out, summary_tail=text_view.SUMMARY_TAIL)
            if hook == "closed":
                self.view.closed(*args)


def _name(view: RunObserver) -> str:
    name = type(view).__name__
    return name[:-4].lower() if name.endswith("View") else name
