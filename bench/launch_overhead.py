"""Launch overhead of ``%%xla_spawn`` against a bare ``xmp.spawn``.

In one process, for each replica count N, five paths run a trivial cell, interleaved
(the order rotates every iteration, so drift and position effects hit all alike):

* bare:  ``xmp.spawn(trivial, start_method='fork')`` of a module-level function, with
         PJRT_DEVICE=CPU and CPU_NUM_DEVICES=N set around the call (then restored);
* magic: ``shell.run_cell_magic('xla_spawn', '-n N', 'index')`` in a real IPython shell
         after ``%load_ext colab_xla`` (its printed summary goes to a StringIO);
* core:  ``colab_xla.notebook.targets.run_cell('index', replicas=N, announce=None)``, no IPython;
* threads: the magic with ``--simulate threads``: one replica process of N threads, as bare
         ``xmp.spawn`` runs them on CPU (the default simulation forks one process per
         replica, as on a TPU host: each fork of a notebook process costs ~10 ms here);
* forks: ``peer_jobs.fork_each(N)``: N processes forked and joined, each calling the trivial
         function: the floor of the default simulation's model, one process per replica.

Warm-up runs (torch_xla import, the lock Manager's start) are excluded. Reported per
path: median and p10/p90 in ms; against bare: the median of paired differences (each
iteration's time minus that iteration's bare time, robust to drift) and the ratio of
medians. Writes the "launch_overhead" section of results.md and results/launch_overhead.json.

    python bench/launch_overhead.py [--repeats 20] [--replicas 1,4,8] [--out DIR]
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (bench_parser, machine_info, machine_line, paired,  # noqa: E402
                      publish, replica_counts, rotated, stats)
from colab_xla.notebook import state, torch_xla_import  # noqa: E402
from colab_xla.notebook.launch import environ  # noqa: E402
from colab_xla.wire import shared_tensors  # noqa: E402
from peer_jobs import fork_each, trivial  # noqa: E402

NAME = "launch_overhead"
GOAL_MS = 30.0
PIPES = 200  # named pipes made and removed in each place (pipe_cost_us)
PATHS = ("bare", "magic", "core", "threads", "forks")


# The bare path gets what %%xla_spawn itself uses: torch_xla imported without writing a
# default PJRT_DEVICE, and variables set for the forked replicas only.
import_xmp = torch_xla_import.import_torch_xla


def make_paths(n: int) -> Dict[str, Callable[[], float]]:
    """Each path runs once and returns its wall time in seconds (checking the result)."""
    from IPython.core.interactiveshell import InteractiveShell

    from colab_xla.notebook.targets import run_cell

    xmp = import_xmp()
    shell = InteractiveShell.instance()
    if "xla_spawn" not in shell.magics_manager.magics["cell"]:
        shell.run_line_magic("load_ext", "colab_xla")
    expected = {i: i for i in range(n)}

    def bare() -> float:
        with environ({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(n)}):
            t0 = time.perf_counter()
            xmp.spawn(trivial, start_method="fork")
            return time.perf_counter() - t0

    def magic(options: str = "") -> float:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            t0 = time.perf_counter()
            shell.run_cell_magic("xla_spawn", f"-n {n}{options}", "index")  # raises if one failed
            elapsed = time.perf_counter() - t0
        if f": {n} done" not in out.getvalue():  # headline "N replicas on CPU: N done in ..."
            raise RuntimeError(f"%%xla_spawn -n {n}: unexpected summary:\n{out.getvalue()}")
        return elapsed

    def core() -> float:
        t0 = time.perf_counter()
        outcome = run_cell("index", replicas=n, announce=None)
        elapsed = time.perf_counter() - t0
        if outcome.failed or outcome.results() != expected:
            raise RuntimeError(f"run_cell replicas={n}: failed={outcome.failed} "
                               f"results={outcome.results()}")
        return elapsed

    def forks() -> float:
        t0 = time.perf_counter()
        fork_each(n)
        return time.perf_counter() - t0

    return {"bare": bare, "magic": magic, "core": core,
            "threads": lambda: magic(" --simulate threads"), "forks": forks}


def measure(n: int, repeats: int, warmups: int) -> dict:
    paths = make_paths(n)
    for _ in range(warmups):
        for name in PATHS:
            paths[name]()
    samples: Dict[str, List[float]] = {name: [] for name in PATHS}
    for i in range(repeats):
        for name in rotated(PATHS, i):
            samples[name].append(paths[name]() * 1e3)
    result = {"replicas": n, "samples_ms": samples,
              "stats_ms": {name: stats(samples[name]) for name in PATHS}}
    for name in ("magic", "core", "threads"):
        result[f"{name}_minus_bare_ms"] = paired(samples[name], samples["bare"])
        result[f"{name}_ratio_of_medians"] = (result["stats_ms"][name]["median"]
                                              / result["stats_ms"]["bare"]["median"])
    for name in ("magic", "core"):
        result[f"{name}_minus_forks_ms"] = paired(samples[name], samples["forks"])
    return result


def pipe_cost_us(count: int = PIPES) -> Dict[str, Optional[float]]:
    """Median µs to make and remove a named pipe where a run makes its pipes (tmpfs, next to
    its output rings) and where it made them before (its directory in the state directory,
    under TMPDIR), interleaved; None where there is no tmpfs."""
    where = {"tmpfs": shared_tensors.SHM_ROOT, "state_dir": state.own_dir("work")}
    dirs = {name: tempfile.mkdtemp(prefix="bench-pipes-", dir=parent)
            for name, parent in where.items() if os.path.isdir(parent)}
    samples: Dict[str, List[float]] = {name: [] for name in dirs}
    try:
        for i in range(count):
            for name in rotated(list(dirs), i):
                path = os.path.join(dirs[name], f"pipe-{i}")
                t0 = time.perf_counter()
                os.mkfifo(path, 0o600)
                os.unlink(path)
                samples[name].append((time.perf_counter() - t0) * 1e6)
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    return {name: statistics.median(samples[name]) if name in samples else None
            for name in where}


def _cell(s: Dict[str, float]) -> str:
    return f"{s['median']:.1f} ({s['p10']:.1f}–{s['p90']:.1f})"


def _signed(s: Dict[str, float]) -> str:
    return f"{s['median']:+.1f} ({s['p10']:+.1f}…{s['p90']:+.1f})"


def _goal(results: List[dict], path: str) -> str:
    misses = [r for r in results if r[f"{path}_minus_bare_ms"]["median"] > GOAL_MS]
    return ("**met** for every replica count" if not misses else "**not met** for " + ", ".join(
        f"N={r['replicas']} ({r[f'{path}_minus_bare_ms']['median']:+.1f} ms)" for r in misses))


def render(results: List[dict], info: dict, seconds: float,
           pipes: Dict[str, Optional[float]]) -> str:
    lines = [
        "## Launch overhead",
        "",
        "`%%xla_spawn -n N` of the trivial cell `index` (through a real IPython shell) against "
        "a bare `xmp.spawn(trivial, start_method='fork')` of a module-level function, and "
        "the IPython-free core `run_cell('index', replicas=N)`, and `%%xla_spawn -n N "
        "--simulate threads` (one process of N replica threads, as bare `xmp.spawn` runs them "
        "on CPU; the default simulation forks a process per replica, as on a TPU host), "
        "interleaved in one process. "
        "Times in ms: median (p10–p90). Overhead: median of paired differences, each "
        "iteration's time minus that iteration's bare time (p10…p90). Ratio: median over "
        "bare median.",
        "",
        "| replicas | bare xmp.spawn ms | %%xla_spawn ms | overhead ms | ratio "
        "| core run_cell ms | core overhead ms | `--simulate threads` ms | threads overhead ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["stats_ms"]
        lines.append(
            f"| {r['replicas']} | {_cell(s['bare'])} | {_cell(s['magic'])} "
            f"| {_signed(r['magic_minus_bare_ms'])} | {r['magic_ratio_of_medians']:.2f}× "
            f"| {_cell(s['core'])} | {_signed(r['core_minus_bare_ms'])} "
            f"| {_cell(s['threads'])} | {_signed(r['threads_minus_bare_ms'])} |")
    lines += [
        "",
        "The floor of the default simulation's own model, one process per replica: "
        "`peer_jobs.fork_each(N)` forks N processes from the same process and joins them, "
        "each calling the trivial function (interleaved with the rest).",
        "",
        "| replicas | N forked processes ms | %%xla_spawn over it ms | core run_cell over it ms |",
        "|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['replicas']} | {_cell(r['stats_ms']['forks'])} "
                     f"| {_signed(r['magic_minus_forks_ms'])} "
                     f"| {_signed(r['core_minus_forks_ms'])} |")
    pjrt = info["notebook_PJRT_DEVICE"] or "unset"
    largest = results[-1]
    lines += [
        "",
        f"Goal (%%xla_spawn at most {GOAL_MS:.0f} ms above bare xmp.spawn at the median): "
        f"default simulation (a process per replica) {_goal(results, 'magic')}; "
        f"`--simulate threads` {_goal(results, 'threads')}. What the default pays beyond "
        "bare xmp.spawn (one process of N threads on CPU) is mostly the forks themselves: "
        f"at N={largest['replicas']}, forking N bare processes takes "
        f"{largest['stats_ms']['forks']['median']:.0f} ms, and %%xla_spawn is "
        f"{largest['magic_minus_forks_ms']['median']:+.1f} ms from that floor (each fork "
        "copies the page tables of a notebook process with torch_xla imported, and each "
        "exit tears them down).",
        "",
        "A run makes 2 named pipes per replica process, and 2 more. Made and removed, a pipe "
        + (f"costs {pipes['tmpfs']:.1f} µs in tmpfs (`/dev/shm`, where a run makes them, "
           "next to its output rings)" if pipes["tmpfs"] is not None else
           "cannot be made in tmpfs here (no `/dev/shm`)")
        + f", and {pipes['state_dir']:.1f} µs in the state directory under TMPDIR "
        f"(where the run makes them without tmpfs); median of {PIPES} each, interleaved.",
        "",
        machine_line(info, NAME, seconds,
                     f"{info['repeats']} repeats after {info['warmups']} warm-ups per path; "
                     f"notebook PJRT_DEVICE {pjrt}", packages=f"IPython {info['ipython']}"),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per path (20)")
    parser.add_argument("--warmups", type=int, default=2, help="untimed runs per path (2)")
    parser.add_argument("--replicas", default="1,4,8", help="replica counts (1,4,8)")
    args = parser.parse_args(argv)
    counts = replica_counts(args.replicas)
    if args.repeats < 2 or not counts or min(counts) < 1:
        parser.error("need --repeats >= 2 and replica counts >= 1")

    started = time.perf_counter()
    info = machine_info(args.repeats, args.warmups)
    results = []
    for n in counts:
        t0 = time.perf_counter()
        r = measure(n, args.repeats, args.warmups)
        results.append(r)
        s = r["stats_ms"]
        print(f"launch_overhead: N={n}: bare {s['bare']['median']:.1f} ms, "
              f"%%xla_spawn {s['magic']['median']:.1f} ms "
              f"({r['magic_minus_bare_ms']['median']:+.1f}), core {s['core']['median']:.1f} ms "
              f"({r['core_minus_bare_ms']['median']:+.1f}) [{time.perf_counter() - t0:.0f} s]",
              file=sys.stderr)
    pipes = pipe_cost_us()
    seconds = time.perf_counter() - started
    markdown = render(results, info, seconds, pipes)
    return publish(NAME, markdown, {"machine": info, "seconds": seconds, "goal_ms": GOAL_MS,
                                    "results": results, "pipe_cost_us": pipes},
                   out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
