"""First-output latency of ``%%xla_spawn``: a replica's ``print`` to the notebook side.

In one process, ``colab_xla.notebook.targets.run_cell`` runs a cell in which every replica takes
``time.time()`` right before it prints one line carrying that timestamp, then sleeps (so
the run is still going when the line arrives). A :class:`colab_xla.notebook.outcome.RunObserver`
records ``time.time()`` when each line reaches the notebook side (``output``, called by
run_cell's reading loop: this is where a live view gets the line) and when the next
``tick`` comes after it (the live views draw at ticks: at once, or at most every
``TICK_SECONDS`` while output floods).

Reported, in ms, median and p10/p90 over every replica of every run:

* print -> observer: the line is in the notebook's process, handed to the view;
* print -> next tick: the view draws it (the text view prints its batch; the widget
  updates its model), so this adds up to one tick period.

Writes the "output_latency" section of results.md and results/output_latency.json.

    python bench/output_latency.py [--repeats 15] [--replicas 4] [--sleep 1.0] [--out DIR]
"""

from __future__ import annotations

import bisect
import os
import re
import sys
import time
from typing import Dict, List

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (bench_parser, machine_info, machine_line, publish,  # noqa: E402
                      replica_counts, stats)

NAME = "output_latency"
_STAMP = re.compile(r"^stamp (\d+) ([0-9.]+)$")

CELL = """\
import time
_t = time.time()
print(f"stamp {{index}} {{_t!r}}")
time.sleep({sleep!r})
"""


def make_observer():
    from colab_xla.notebook.outcome import RunObserver

    class Recorder(RunObserver):
        """Wall-clock arrival of every stamped line, and the times of ticks."""

        def __init__(self):
            self.arrivals: List[tuple] = []  # (ordinal, stamp, arrived)
            self.ticks: List[float] = []
            self.opened_at = None

        def opened(self, outcome):
            self.opened_at = time.time()

        def output(self, outcome, origin, lines):
            now = time.time()
            for line in lines:
                m = _STAMP.match(line)
                if m:
                    self.arrivals.append((int(m.group(1)), float(m.group(2)), now))

        def tick(self, outcome):
            self.ticks.append(time.time())

    return Recorder


def run_once(n: int, sleep: float) -> List[Dict[str, float]]:
    from colab_xla.notebook.targets import run_cell

    recorder = make_observer()()
    outcome = run_cell(CELL.format(sleep=sleep), replicas=n, announce=None, observer=recorder)
    if outcome.failed:
        raise RuntimeError(f"run_cell failed: {[r.error for r in outcome.replicas.values()]}")
    if sorted(o for o, _, _ in recorder.arrivals) != list(range(n)):
        raise RuntimeError(f"expected one stamped line per replica, got {recorder.arrivals}")
    samples = []
    for ordinal, stamp, arrived in recorder.arrivals:
        i = bisect.bisect_left(recorder.ticks, arrived)
        tick = recorder.ticks[i] if i < len(recorder.ticks) else None
        samples.append({"replica": ordinal, "to_observer_ms": (arrived - stamp) * 1e3,
                        "to_tick_ms": None if tick is None else (tick - stamp) * 1e3,
                        "tick_wait_ms": None if tick is None else (tick - arrived) * 1e3,
                        "print_after_open_ms": (stamp - recorder.opened_at) * 1e3})
    return samples


def render(result: dict, info: dict, seconds: float) -> str:
    obs, tick, wait = result["to_observer_ms"], result["to_tick_ms"], result["tick_wait_ms"]
    opened = result["print_after_open_ms"]
    lines = [
        "## Output latency",
        "",
        "First-output latency of `run_cell` (the core of `%%xla_spawn`): each replica takes "
        "`time.time()` right before `print`ing one line carrying it, then sleeps; a "
        "`RunObserver` takes `time.time()` when the line reaches the notebook side "
        "(`output`, where a live view gets it) and at the next `tick` (when the views draw "
        "it: at once, or at most every "
        f"{result['tick_ms']:.0f} ms while output floods). ms, over {tick['n']} lines "
        f"({info['repeats']} runs × {result['replicas']} replicas).",
        "",
        "| print → | median ms | p10–p90 ms | max ms |",
        "|---|---:|---:|---:|",
        f"| notebook side (observer `output`) | {obs['median']:.2f} | "
        f"{obs['p10']:.2f}–{obs['p90']:.2f} | {obs['max']:.2f} |",
        f"| drawn by the view (next `tick`) | {tick['median']:.1f} | "
        f"{tick['p10']:.1f}–{tick['p90']:.1f} | {tick['max']:.1f} |",
        f"| (wait from notebook side to next tick) | {wait['median']:.1f} | "
        f"{wait['p10']:.1f}–{wait['p90']:.1f} | {wait['max']:.1f} |",
        "",
        "A line is handed to the view as soon as it arrives; the view draws it at once, "
        "unless it drew less than an interval ago (then when the interval has passed): the "
        f"interval starts at `NEXT_DRAW_SECONDS` ({result['next_draw_ms']:.0f} ms) and doubles "
        f"while output keeps waiting, up to `TICK_SECONDS` ({result['tick_ms']:.0f} ms; a few "
        "updates a second keep the browser responsive). The replicas printed "
        f"{opened['median']:.0f} ms (median) after the run opened.",
        "",
        machine_line(info, NAME, seconds,
                     f"{info['repeats']} runs of {result['replicas']} replicas after "
                     f"{info['warmups']} warm-up, sleep {result['sleep']:g} s"),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=15, help="timed runs (15)")
    parser.add_argument("--warmups", type=int, default=1, help="untimed runs (1)")
    parser.add_argument("--replicas", default="4",
                        help="replicas per run "
                             "(4; of a list such as bench/run passes, the largest)")
    parser.add_argument("--sleep", type=float, default=1.0,
                        help="seconds each replica sleeps after its line (1.0)")
    args, _ = parser.parse_known_args(argv)  # bench/run passes every benchmark's options
    n = max(replica_counts(args.replicas)) if args.replicas else 4
    if args.repeats < 1 or n < 1:
        parser.error("need --repeats >= 1 and replicas >= 1")

    from colab_xla.notebook.draw_pacing import NEXT_DRAW_SECONDS, TICK_SECONDS

    started = time.perf_counter()
    info = machine_info(args.repeats, args.warmups)
    for _ in range(args.warmups):
        run_once(n, args.sleep)
    samples = []
    for run in range(args.repeats):
        for s in run_once(n, args.sleep):
            samples.append({"run": run, **s})
    to_obs = [s["to_observer_ms"] for s in samples]
    to_tick = [s["to_tick_ms"] for s in samples if s["to_tick_ms"] is not None]
    waits = [s["tick_wait_ms"] for s in samples if s["tick_wait_ms"] is not None]
    result = {"replicas": n, "sleep": args.sleep, "tick_ms": TICK_SECONDS * 1e3,
              "next_draw_ms": NEXT_DRAW_SECONDS * 1e3,
              "to_observer_ms": {**stats(to_obs), "n": len(to_obs)},
              "to_tick_ms": {**stats(to_tick), "n": len(to_tick)},
              "tick_wait_ms": {**stats(waits), "n": len(waits)},
              "print_after_open_ms": stats([s["print_after_open_ms"] for s in samples]),
              "samples": samples}
    seconds = time.perf_counter() - started
    markdown = render(result, info, seconds)
    return publish(NAME, markdown, {"machine": info, "seconds": seconds, **result},
                         out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
