"""The outcome of a run as plain text, grouped by replica.

This is what terminals, logs, saved notebooks and tests read; a widget view renders the
same :class:`~colab_xla.outcome.RunOutcome`.

Example::

    >>> from colab_xla.outcome import RunOutcome, ReplicaOutcome
    >>> o = RunOutcome("CPU", {0: ReplicaOutcome(0, "done", elapsed=0.5)})
    >>> _ = o.replicas[0].log.write("stdout", "hi\\n")
    >>> print(render(o))
    1 replica on CPU: 1 done
    ── replica 0 · done · 0.50 s
    hi
"""

from __future__ import annotations

from typing import List

from .outcome import RunOutcome, ReplicaOutcome


def render(outcome: RunOutcome) -> str:
    """The whole run: a headline, then each replica's output, result and state."""
    lines = [headline(outcome)]
    for label, log in sorted(outcome.processes.items()):
        lines.append(f"── {label} (output not tied to one replica)")
        lines.extend(_block(log.tail_text()))
    for ordinal in sorted(outcome.replicas):
        lines.extend(_replica(outcome.replicas[ordinal]))
    return "\n".join(lines)


def headline(outcome: RunOutcome) -> str:
    n = len(outcome.replicas)
    counts = {}
    for rep in outcome.replicas.values():
        counts[rep.state] = counts.get(rep.state, 0) + 1
    states = ", ".join(f"{c} {s}" for s, c in sorted(counts.items()))
    took = f" in {outcome.elapsed:.2f} s" if outcome.elapsed is not None else ""
    noun = "replica" if n == 1 else "replicas"
    stopped = " (interrupted)" if outcome.interrupted else ""
    return f"{n} {noun} on {outcome.device_type}: {states}{took}{stopped}"


def _replica(rep: ReplicaOutcome) -> List[str]:
    took = f" · {rep.elapsed:.2f} s" if rep.elapsed is not None else ""
    lines = [f"── replica {rep.ordinal} · {rep.state}{took}"]
    lines.extend(_block(rep.text))
    if rep.value_repr is not None and rep.error is None:
        lines.append(f"Out: {rep.value_repr}")
    if rep.error is not None:
        lines.append(f"{rep.error.ename}: {rep.error.evalue}" if rep.error.kind != "exception"
                     else rep.error.render().splitlines()[-1])
    return lines


def _block(text: str) -> List[str]:
    return text.rstrip("\n").split("\n") if text.strip() else []
