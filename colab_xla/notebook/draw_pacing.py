"""When a run's live views draw: :class:`DrawPacer`, and its intervals.

Views draw output at once, unless they drew less than an interval ago (then when it has
passed): the interval starts at :data:`NEXT_DRAW_SECONDS` and doubles while output keeps
waiting for draws, up to :data:`TICK_SECONDS` (a few updates a second keep the browser
responsive); without output, a draw (elapsed times) comes every :data:`TICK_SECONDS`. The
:class:`colab_xla.notebook.supervisor.Supervisor`'s read loop asks the pacer when to draw;
the pacer only does arithmetic on the times it is given.
"""

from __future__ import annotations

from typing import Optional

TICK_SECONDS = 0.25
NEXT_DRAW_SECONDS = 0.01


class DrawPacer:
    """When the live views draw (``tick``): output at once, unless the last draw was less
    than an interval ago (then when it has passed). A draw whose output had to wait
    doubles the interval, from NEXT_DRAW_SECONDS up to TICK_SECONDS (a flood settles at a
    few draws a second); output that comes later than that (replicas starting one after
    another) sets it back. Without output, a draw every TICK_SECONDS. Times are
    ``time.monotonic()`` seconds, given by the caller.

    >>> p = DrawPacer(now=0.0)
    >>> p.drew(0.3); p.output(0.4); p.due  # drawn at once
    0.4
    """

    def __init__(self, now: float):
        self.due = now + TICK_SECONDS  # the next draw
        self._last, self._interval = float("-inf"), NEXT_DRAW_SECONDS
        self._since: Optional[float] = None  # when output came that no draw has shown yet

    def output(self, now: float) -> None:
        """Output came (again) that is not drawn yet."""
        if self._since is None:
            self._since = now
            self.due = min(self.due, max(now, self._last + self._interval))

    def drew(self, now: float) -> None:
        """The views drew at ``now``."""
        if self._since is not None:
            waited = self._since < self._last + self._interval
            self._interval = (min(TICK_SECONDS, self._interval * 2) if waited
                              else NEXT_DRAW_SECONDS)
            self._last, self._since = now, None
        self.due = now + TICK_SECONDS
