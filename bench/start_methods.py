"""What each start method costs: a trivial cell under fork, warm forkserver and spawn.

In one process, for each replica count N, ``colab_xla.notebook.targets.run_cell('index', replicas=N,
launch=Launch(method))`` runs interleaved for the three start methods (the order rotates
every iteration). The forkserver is started (and its torch/torch_xla import waited for) by
a first run that is timed on its own: the "cold" figure, paid once per notebook process.
spawn imports torch and torch_xla in every replica process on every run, so it gets fewer
repeats (``--spawn-repeats``).

Reported: median and p10/p90 in ms, and the ratio of medians to fork. Writes the
"start_methods" section of results.md and results/start_methods.json.

    python bench/start_methods.py [--repeats 10] [--spawn-repeats 3] [--replicas 1,4,8]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Dict, List

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (bench_parser, machine_info, machine_line, publish,  # noqa: E402
                      replica_counts, rotated, stats)

from colab_xla.notebook.launch import Launch  # noqa: E402
from colab_xla.notebook.targets import run_cell  # noqa: E402

NAME = "start_methods"
METHODS = ("fork", "forkserver", "spawn")


def timed_run(method: str, n: int) -> float:
    t0 = time.perf_counter()
    outcome = run_cell("index", replicas=n, announce=None, launch=Launch(method))
    elapsed = time.perf_counter() - t0
    if outcome.results() != {i: i for i in range(n)}:
        raise RuntimeError(f"{method} N={n}: {outcome.results()} "
                           f"{[r.error for r in outcome.replicas.values()]}")
    return elapsed * 1e3


def measure(n: int, repeats: int, spawn_repeats: int) -> dict:
    samples: Dict[str, List[float]] = {m: [] for m in METHODS}
    for i in range(repeats):
        order = rotated(METHODS, i)
        for method in order:
            if method == "spawn" and len(samples["spawn"]) >= spawn_repeats:
                continue
            samples[method].append(timed_run(method, n))
    result = {"replicas": n, "samples_ms": samples,
              "stats_ms": {m: stats(s) for m, s in samples.items()}}
    fork = result["stats_ms"]["fork"]["median"]
    result["ratio_to_fork"] = {m: result["stats_ms"][m]["median"] / fork for m in METHODS}
    return result


def render(results: List[dict], cold_ms: float, info: dict, seconds: float) -> str:
    lines = [
        "## Start methods: fork, warm forkserver, spawn",
        "",
        "A trivial cell (`index`) through `run_cell(..., launch=Launch(method))`, interleaved. "
        "Median ms (p10-p90) and the ratio of medians to fork.",
        "",
        "| replicas | fork | forkserver (warm) | spawn | forkserver / fork | spawn / fork |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["stats_ms"]

        def cell(m):
            return f"{s[m]['median']:.0f} ({s[m]['p10']:.0f}-{s[m]['p90']:.0f})"

        lines.append(f"| {r['replicas']} | {cell('fork')} | {cell('forkserver')} | "
                     f"{cell('spawn')} | {r['ratio_to_fork']['forkserver']:.2f}x | "
                     f"{r['ratio_to_fork']['spawn']:.1f}x |")
    repeats = {m: len(results[0]["samples_ms"][m]) for m in METHODS}
    lines += [
        "",
        f"The forkserver's first run in this process (it starts the server, which imports "
        f"torch and torch_xla once): {cold_ms:.0f} ms. After that, replicas fork from it warm. "
        "spawn pays that import in every replica process of every run.",
        "",
        machine_line(info, NAME, seconds,
                     f"repeats per replica count: fork {repeats['fork']}, forkserver "
                     f"{repeats['forkserver']}, spawn {repeats['spawn']}"),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=10, help="runs of fork/forkserver (10)")
    parser.add_argument("--spawn-repeats", type=int, default=3, help="runs of spawn (3)")
    parser.add_argument("--replicas", default="1,4,8", help="replica counts (1,4,8)")
    args = parser.parse_args(argv)
    counts = replica_counts(args.replicas)
    if args.repeats < 2 or not 2 <= args.spawn_repeats <= args.repeats or not counts:
        parser.error("need 2 <= --spawn-repeats <= --repeats, and replica counts")
    started = time.perf_counter()
    info = machine_info(args.repeats, 1)
    timed_run("fork", counts[0])  # warm: torch_xla import in this process
    cold_ms = timed_run("forkserver", counts[0])
    results = []
    for n in counts:
        results.append(measure(n, args.repeats, args.spawn_repeats))
        s = results[-1]["stats_ms"]
        print(f"start_methods: N={n}: " + ", ".join(f"{m} {s[m]['median']:.0f} ms"
                                                   for m in METHODS), file=sys.stderr)
    seconds = time.perf_counter() - started
    return publish(NAME, render(results, cold_ms, info, seconds),
                   {"machine": info, "seconds": seconds, "forkserver_cold_ms": cold_ms,
                    "results": results}, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
