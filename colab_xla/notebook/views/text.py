"""The outcome of a run as plain text, grouped by replica, and a live text view.

This is what terminals, logs, saved notebooks and tests read; the widget view renders the
same :class:`~colab_xla.notebook.outcome.RunOutcome`.

Example::

    >>> from colab_xla.notebook.outcome import RunOutcome, ReplicaOutcome
    >>> o = RunOutcome("CPU", {0: ReplicaOutcome(0, "done", elapsed=0.5)})
    >>> _ = o.replicas[0].log.write("stdout", "hi\\n")
    >>> print(render(o))
    1 replica on CPU: 1 done
    ── replica 0 · done · 0.50 s
    hi
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional

from ...wire.displays import Display
from ...wire.reports import ReplicaError
from ..outcome import ReplicaOutcome, RunObserver, RunOutcome, Stall, fraction
from ..output_log import OutputLog, shorten

# Output lines per replica in a summary (the full log is on disk).
SUMMARY_TAIL = 20
# Lines per replica the live text view prints before it only points at the log.
LIVE_LINES = 200


def render(outcome: RunOutcome, tail: Optional[int] = SUMMARY_TAIL) -> str:
    """The whole run: a headline, then each replica's last output lines, result, state.

    ``tail`` bounds the output lines per replica (None: all that are kept, 0: none).
    """
    lines = [headline(outcome)]
    for label, log in sorted(outcome.processes.items()):
        if tail != 0:
            lines.append(f"── {label} (output not tied to one replica)")
            lines.extend(tail_lines(log, tail))
    for ordinal in sorted(outcome.replicas):
        lines.extend(_replica(outcome.replicas[ordinal], tail, outcome.label(ordinal)))
    if outcome.log_dir and any(r.log.truncated for r in outcome.replicas.values()):
        lines.append(f"full logs: {outcome.log_dir}")
    return "\n".join(lines)


def headline(outcome: RunOutcome, values: bool = True) -> str:
    """``4 replicas on CPU: 4 done in 3.41 s · results in `outs```: the replicas'
    :func:`states`, the wait (start-up included) and, with ``values``, :func:`values_note`."""
    n = len(outcome.replicas)
    took = f" in {outcome.elapsed:.2f} s" if outcome.elapsed is not None else ""
    noun = "replica" if n == 1 else "replicas"
    stopped = " (interrupted)" if outcome.interrupted else ""
    note = values_note(outcome) if values else ""
    return f"{n} {noun} on {outcome.device_type}: {states(outcome)}{took}{stopped}{note}"


def states(outcome: RunOutcome) -> str:
    """How many replicas are in each state (``3 done, 1 failed``), or why none started."""
    if outcome.launch_error is not None and not outcome.replicas:
        return f"not started ({outcome.launch_error.ename})"
    counts: Dict[str, int] = {}
    for rep in outcome.replicas.values():
        counts[rep.state] = counts.get(rep.state, 0) + 1
    return ", ".join(f"{c} {s}" for s, c in sorted(counts.items()))


def values_note(outcome: RunOutcome, code=lambda name: f"`{name}`") -> str:
    """Where the run's values went, as the headline ends: `` · results in `outs``` (-o),
    `` · `-o outs` kept its earlier value`` (no replica sent one); ``code`` marks a name."""
    note = f" · results in {code(outcome.stored_as)}" if outcome.stored_as else ""
    if outcome.kept:
        its = "its" if len(outcome.kept) == 1 else "their"
        note += f" · {', '.join(code(k) for k in outcome.kept)} kept {its} earlier value"
    return note


def error_line(error: ReplicaError) -> str:
    """The one line that says what went wrong (the traceback's last line)."""
    if error.kind == "exception" and error.traceback:
        return error.traceback.rstrip("\n").splitlines()[-1]
    return error.render()


def drawn_note(shown: Display) -> str:
    """What the text view says of a display it cannot draw."""
    mimes = ", ".join(m for m in shown.bundle if m != "text/plain")
    return f"displayed {mimes}: the widget view and the saved notebook draw it"


def tail_lines(log: OutputLog, tail: Optional[int]) -> List[str]:
    """The log's last ``tail`` lines (None: all kept), after a note of the earlier ones; a
    display among them stays one (a :class:`~colab_xla.wire.displays.Display`)."""
    lines = [line if isinstance(line, Display) else shorten(line) for line in log.items()]
    if tail is not None and len(lines) > tail:
        skipped = log.truncated + len(lines) - tail
        lines = [log.earlier_note(skipped)] + lines[-tail:] if tail else []
    elif log.truncated:
        lines = [log.earlier_note()] + lines
    return lines


def _replica(rep: ReplicaOutcome, tail: Optional[int], label: str) -> List[str]:
    took = f" · {rep.elapsed:.2f} s" if rep.elapsed is not None else ""
    lines = [f"── {label} · {rep.state}{took}"]
    lines.extend(tail_lines(rep.log, tail))
    if rep.value_repr is not None and rep.error is None:
        lines.append(f"Out: {rep.value_repr}")
    if rep.pulled:
        lines.append(f"Pulled: {rep.pulled_summary()}")
    if rep.error is not None:
        lines.append(error_line(rep.error))
    return lines


class TextView(RunObserver):
    """Live text: each completed line as ``[replica 3] ...``, then a compact summary.

    Lines are printed in batches, once per tick, so a chatty run sends a few messages a
    second to the notebook rather than one per line; after :data:`LIVE_LINES` lines of a
    replica, the rest is only in its log file (the summary says where).
    """

    def __init__(self, out=None, summary_tail: Optional[int] = 0):
        self._out = out or sys.stdout
        # The summary's output lines per replica: none, as they were printed live; more
        # when the text view took over from a widget view mid-run (see views.FallbackView).
        self._summary_tail = summary_tail
        self._batch: List[str] = []
        self._printed: Dict[object, int] = {}
        self._stalled_at: Optional[dict] = None  # the places of the last notice printed
        self._bar_steps: Dict[tuple, int] = {}  # (replica, bar) -> the tenth last printed

    def output(self, outcome: RunOutcome, origin, lines: List[str]) -> None:
        label = f"[{outcome.label(origin)}]" if isinstance(origin, int) else f"[{origin}]"
        count = self._printed.get(origin, 0)
        for line in lines:
            count += 1
            if count <= LIVE_LINES:
                self._batch.append(f"{label} {shorten(line)}")
                if isinstance(line, Display) and line.drawn:
                    self._batch.append(f"{label} ({drawn_note(line)})")
            elif count == LIVE_LINES + 1:
                self._batch.append(f"{label} ... (more output: only in the full log)")
        self._printed[origin] = count

    def tick(self, outcome: RunOutcome) -> None:
        for ordinal, rep in outcome.replicas.items():  # a bar's line at each tenth it passes
            for key, bar in rep.progress.items():
                if bar.get("closed"):  # (its last line is among the replica's lines)
                    continue
                done = fraction(bar)
                step = int(done * 10) if done is not None else (bar.get("n") or 0).bit_length()
                if self._bar_steps.get((ordinal, key)) != step:
                    self._bar_steps[(ordinal, key)] = step
                    self._batch.append(f"[{outcome.label(ordinal)}] {bar.get('text', '')}")
        if self._batch:
            print("\n".join(self._batch), file=self._out, flush=True)
            self._batch = []

    def stalled(self, outcome: RunOutcome, stall: Optional[Stall]) -> None:
        # Printed text cannot go away: a notice is printed when it says something new.
        if stall is None:
            self._stalled_at = None
        elif dict(stall.places) != self._stalled_at:
            self._stalled_at = dict(stall.places)
            print("\n".join(f"[colab_xla] {line}" for line in stall.notice(outcome).splitlines()),
                  file=self._out, flush=True)

    def closed(self, outcome: RunOutcome) -> None:
        self.tick(outcome)
        # Flushed where nothing else would send it soon: not in a kernel, which sends what
        # a cell printed before the cell's next message (a display, an error, its reply),
        # and whose flush is a round trip to its IOPub thread (~1 ms of a warm cell).
        flush = not _kernel_stream(self._out)
        print(render(outcome, tail=self._summary_tail), file=self._out, flush=flush)
        if outcome.log_dir and self._printed:
            print(f"full logs: {outcome.log_dir}", file=self._out, flush=flush)


def _kernel_stream(stream) -> bool:
    """Whether ``stream`` is an ipykernel output stream (sys.stdout in a kernel)."""
    iostream = sys.modules.get("ipykernel.iostream")
    return iostream is not None and isinstance(stream, iostream.OutStream)
