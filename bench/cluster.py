"""A cell on a cluster of hosts through Ray (``colab_xla.notebook.cluster``), against a one-off
local run, on this machine's local cluster.

In one process (PJRT_DEVICE=CPU), a local cluster of H hosts x N replicas
(``cluster.start_local(H, N)``: a Ray head and H Ray nodes on 127.0.0.1, one agent each)
is started once (start-up timed apart), then:

1. a trivial cell (``index``), alternating (the order rotates every iteration): on the
   cluster (``run_on_cluster``) and as a one-off local ``run_cell(..., replicas=H*N)``.
   With ``--one-host`` (the default), a 1-host cluster of H*N replicas is started after
   the first one is stopped, and measured the same way against the one-off run again.
   Medians, p10/p90, and ratios of medians to the one-off run's (in the same phase).
2. first-output latency: ``print(index)`` as the whole cell; from the call to
   ``run_on_cluster`` until a :class:`RunObserver` sees the first line of a replica of
   host 1 (a remote host: its agent's poll carried it through Ray), and host 0's for
   comparison; the one-off local run's first line likewise.
3. interrupt-to-clean: a cell that prints once, then sleeps forever. Once every replica
   has printed, a timer thread sends SIGINT to this process (``run_on_cluster`` runs in
   the main thread and holds SIGINT as a flag); measured from the signal until
   ``run_on_cluster`` returns with ``outcome.interrupted``. Then every replica's pid
   (``outcome.replicas[i].pid``) is checked with psutil (alive and not a zombie = left).
   The one-off local run is interrupted the same way.

After each cluster is stopped, the processes it started (children of this process seen
while it was up, Ray's included) are checked: any still alive is reported.

Writes the "cluster" section of results.md and results/cluster.json.

    python bench/cluster.py [--hosts 2] [--per-host 2] [--repeats 8] [--latency-repeats 4]
                            [--interrupts 3] [--no-one-host]
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import psutil

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (alive, bench_parser, machine_info, machine_line,  # noqa: E402
                      median_range, paired, publish, stats)
from launch_overhead import _cell  # noqa: E402

from colab_xla.notebook import cluster  # noqa: E402
from colab_xla.notebook.targets.cluster_one_off import run_on_cluster  # noqa: E402
from colab_xla.notebook.launch import environ  # noqa: E402
from colab_xla.notebook.outcome import RunObserver  # noqa: E402
from colab_xla.notebook.targets import run_cell  # noqa: E402

NAME = "cluster"
PATHS = ("cluster", "one_off")
SLEEP_CELL = "import time\nprint('ready', index, flush=True)\nwhile True:\n    time.sleep(0.05)\n"
SIGNAL_DELAY_S = 0.2  # after the last replica's first line
# A run not done by then is cut (``timeout=``) and counted as hung, not measured, so that a
# hang (replicas forked straight from a Ray actor once deadlocked at start) cannot stop the
# benchmark; the section says how many.
HANG_S = 20.0


def _check(outcome, what: str, expected: Dict[int, int]):
    if not outcome.ok or outcome.results() != expected:
        errors = {i: r.error for i, r in outcome.replicas.items() if r.error}
        raise RuntimeError(f"{what}: ok={outcome.ok} results={outcome.results()} "
                           f"errors={errors} launch_error={outcome.launch_error}")
    return outcome


class FirstLines(RunObserver):
    """When each host's first line arrives (``time.monotonic()``); a local run is host 0."""

    def __init__(self):
        self.first: Dict[int, float] = {}

    def output(self, outcome, origin, lines) -> None:
        if not isinstance(origin, int) or not lines:
            return
        host = outcome.hosts.get(origin, 0)
        self.first.setdefault(host, time.monotonic())


class Interrupter(RunObserver):
    """Once every replica has started and printed, SIGINT to this process from a timer."""

    def __init__(self, total: int):
        self.total = total
        self.started_ordinals: set = set()
        self.printed: set = set()
        self.signal_at: Optional[float] = None
        self.timer: Optional[threading.Timer] = None

    def started(self, outcome, ordinal) -> None:
        self.started_ordinals.add(ordinal)
        self._maybe_arm()

    def output(self, outcome, origin, lines) -> None:
        if isinstance(origin, int) and lines:
            self.printed.add(origin)
            self._maybe_arm()

    def _maybe_arm(self) -> None:
        if self.timer is None and len(self.started_ordinals) >= self.total \
                and len(self.printed) >= self.total:
            self.timer = threading.Timer(SIGNAL_DELAY_S, self._fire)
            self.timer.start()

    def _fire(self) -> None:
        self.signal_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)


def interrupt_once(run: Callable[[RunObserver], object], total: int) -> dict:
    observer = Interrupter(total)
    outcome = run(observer)
    returned = time.monotonic()
    if observer.timer is not None:
        observer.timer.join()
    if observer.signal_at is None:
        if outcome.ok:
            raise RuntimeError(f"interrupt: the run ended before the signal: {outcome.replicas}")
        return {"hung": True, "printed": sorted(observer.printed),
                "errors": {i: str(r.error) for i, r in outcome.replicas.items() if r.error}}
    pids = [r.pid for r in outcome.replicas.values() if r.pid]
    left_now = alive(pids)
    time.sleep(1.0)
    left_later = alive(pids)
    return {"ms": (returned - observer.signal_at) * 1e3,
            "interrupted": bool(outcome.interrupted), "pids": pids,
            "states": sorted({r.state for r in outcome.replicas.values()}),
            "left_at_return": left_now, "left_after_1s": left_later, "hung": False}


def first_output_once(run: Callable[[RunObserver], object]) -> Dict[int, float]:
    observer = FirstLines()
    t0 = time.monotonic()
    outcome = run(observer)
    if not outcome.ok:
        if time.monotonic() - t0 < HANG_S * 0.9:
            raise RuntimeError(f"first output: failed: {outcome.replicas}")
        return None  # hung, cut by the timeout
    return {host: (t - t0) * 1e3 for host, t in sorted(observer.first.items())}


def _children() -> Dict[int, str]:
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            found[proc.pid] = " ".join(proc.cmdline()[:2])[:120] or proc.name()
        except psutil.Error:
            pass
    return found


def measure_cluster(hosts: int, per_host: int, args, latency: bool, interrupts: bool) -> dict:
    total = hosts * per_host
    expected = {i: i for i in range(total)}
    t0 = time.perf_counter()
    c = cluster.start_local(hosts, per_host, announce=None)
    start_s = time.perf_counter() - t0
    seen: Dict[int, str] = {}
    result: dict = {"hosts": hosts, "per_host": per_host, "replicas": total,
                    "start_s": start_s}
    try:
        def on_cluster(source: str, observer=None):
            return run_on_cluster(c, source, user_ns={}, announce=None, observer=observer,
                                  timeout=HANG_S)

        def one_off(source: str, observer=None):
            return run_cell(source, replicas=total, announce=None, observer=observer,
                            timeout=HANG_S)

        hung: Dict[str, int] = {name: 0 for name in PATHS}

        def timed(name) -> Optional[float]:
            t = time.perf_counter()
            outcome = paths[name]("index")
            elapsed = time.perf_counter() - t
            if not outcome.ok and elapsed >= HANG_S * 0.9:
                hung[name] += 1  # cut by the timeout: counted, not measured
                print(f"cluster: {hosts}x{per_host}: a trivial run on {name} hung; cut after "
                      f"{elapsed:.0f} s", file=sys.stderr)
                return None
            _check(outcome, "trivial", expected)
            return elapsed * 1e3

        paths = {"cluster": on_cluster, "one_off": one_off}
        for name in PATHS:  # warm-up
            timed(name)
        seen.update(_children())
        samples: Dict[str, List[float]] = {name: [] for name in PATHS}
        for i in range(args.repeats):
            for name in PATHS[i % 2:] + PATHS[:i % 2]:
                ms = timed(name)
                if ms is not None:
                    samples[name].append(ms)
        result["trivial_hung"] = hung
        result["trivial_samples_ms"] = samples
        result["trivial_stats_ms"] = {name: stats(samples[name]) for name in PATHS}
        med = {name: result["trivial_stats_ms"][name]["median"] for name in PATHS}
        result["trivial_ratio_to_one_off"] = med["cluster"] / med["one_off"]
        result["trivial_paired_diff_ms"] = paired(samples["cluster"],
                                                  samples["one_off"])["median"]

        if latency:
            lat = {"cluster": [], "one_off": []}
            for i in range(args.latency_repeats):
                for name in PATHS[i % 2:] + PATHS[:i % 2]:
                    got = first_output_once(
                        lambda obs, f=paths[name]: f("print(index, flush=True)\nindex", obs))
                    if got is None:
                        hung[name] += 1
                    else:
                        lat[name].append(got)
            result["first_output_ms"] = lat

        if interrupts:
            cut = {"cluster": [], "one_off": []}
            for i in range(args.interrupts):
                for name in PATHS[i % 2:] + PATHS[:i % 2]:
                    seen.update(_children())
                    cut[name].append(interrupt_once(
                        lambda obs, f=paths[name]: f(SLEEP_CELL, obs), total))
            result["interrupts"] = cut
        seen.update(_children())
        result["cells_run"] = c.cells_run
    finally:
        cluster.stop()
    time.sleep(2.0)  # Ray's node processes end shortly after shutdown
    result["processes_seen"] = len(seen)
    result["processes_left"] = {pid: seen[pid] for pid in alive(list(seen))}
    return result


def render(results: List[dict], info: dict, seconds: float, args) -> str:
    lines = [
        "## Cluster of hosts (colab_xla.notebook.cluster, local Ray cluster)",
        "",
        "`run_on_cluster` on a local Ray cluster (`cluster.start_local(H, N)`: a Ray head and "
        "H Ray nodes on 127.0.0.1, one agent per host, starting its N replicas from its warm "
        "forkserver) against a one-off local `run_cell(..., replicas=H*N)`, interleaved in "
        "one process (the order rotates each iteration). Each cluster is started once "
        "(start-up in the table), and the one-off run is measured again beside each "
        "cluster. Both hosts of the 2-host "
        "cluster share this machine's cores, so this measures colab_xla's and Ray's "
        "overhead, not a network.",
        "",
        "Trivial cell `index`: ms, median (p10–p90); ratio: cluster median over the one-off "
        "median; paired: median of (cluster − one-off) in the same iteration.",
        "",
        "| cluster | start s | cluster ms | one-off ms (same replicas) | cluster / one-off "
        "| paired diff ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["trivial_stats_ms"]
        lines.append(f"| {r['hosts']} host{'s' if r['hosts'] > 1 else ''} × {r['per_host']} "
                     f"| {r['start_s']:.1f} | {_cell(s['cluster'])} | {_cell(s['one_off'])} "
                     f"| {r['trivial_ratio_to_one_off']:.1f}× "
                     f"| {r['trivial_paired_diff_ms']:+.0f} |")
    main = results[0]
    lat = main.get("first_output_ms")
    if lat:
        remote = [run.get(1) for run in lat["cluster"] if 1 in run]
        host0 = [run.get(0) for run in lat["cluster"] if 0 in run]
        local = [run.get(0) for run in lat["one_off"] if 0 in run]
        lines += [
            "",
            f"First-output latency ({main['hosts']} hosts × {main['per_host']}, cell "
            "`print(index)`): from the call until a `RunObserver` sees the first line of a "
            "replica of host 1 (remote: the line travels through that host's agent and a Ray "
            "poll), of host 0, and of the one-off local run. ms, median (min–max) of "
            f"{args.latency_repeats}; includes starting the replicas.",
            "",
            "| host 1 (remote) | host 0 | one-off local |",
            "|---:|---:|---:|",
            f"| {median_range(remote)} | {median_range(host0)} | {median_range(local)} |",
        ]
    cut = main.get("interrupts")
    if cut:
        lines += [
            "",
            f"Interrupt-to-clean ({main['hosts']} hosts × {main['per_host']}): a cell that "
            f"prints, then sleeps forever; {SIGNAL_DELAY_S:g} s after every replica printed, "
            "a timer thread sends SIGINT to this process; ms from the signal until the call "
            "returns; replicas left: pids still alive (not zombies) when it returned / 1 s "
            f"later, over {args.interrupts} interrupts.",
            "",
            "| path | interrupt → return ms | outcome.interrupted | replica states "
            "| replicas left at return / 1 s later |",
            "|---|---:|---|---|---|",
        ]
        for name, label in (("cluster", "cluster"), ("one_off", "one-off local")):
            runs = [run for run in cut[name] if not run["hung"]]
            if not runs:
                lines.append(f"| {label} | – (every run hung) | | | |")
                continue
            states = sorted({s for run in runs for s in run["states"]})
            lines.append(
                f"| {label} | {median_range([run['ms'] for run in runs])} "
                f"| {sum(run['interrupted'] for run in runs)}/{len(runs)} "
                f"| {', '.join(states)} "
                f"| {sum(len(run['left_at_return']) for run in runs)} / "
                f"{sum(len(run['left_after_1s']) for run in runs)} |")
    hung = [(r, name, r["trivial_hung"][name]) for r in results for name in PATHS
            if r["trivial_hung"][name]]
    hung_cut = sum(run["hung"] for r in results for name in PATHS
                   for run in r.get("interrupts", {}).get(name, []))
    if hung or hung_cut:
        lines += [
            "",
            f"Hung runs (cut by `timeout={HANG_S:g}` and left out of the figures above): "
            + "; ".join(f"{r['hosts']}×{r['per_host']} {name}: {k}" for r, name, k in hung)
            + (f"; interrupt runs: {hung_cut}" if hung_cut else "") + ". "
            "A hang is a bug: agents start replicas from a forkserver because replicas forked "
            "from the agent (a Ray actor, many threads) deadlocked in libc's resolver lock.",
        ]
    left = {pid: cmd for r in results for pid, cmd in r["processes_left"].items()}
    seen = sum(r["processes_seen"] for r in results)
    lines += [
        "",
        ("Processes left after `cluster.stop()` (2 s later): none of the "
         f"{seen} this process's clusters started." if not left else
         f"Processes left after `cluster.stop()` (2 s later): {len(left)} of {seen}: "
         + "; ".join(f"{pid} `{cmd}`" for pid, cmd in sorted(left.items())) + "."),
        "",
        machine_line(info, NAME, seconds,
                     f"trivial cell: {args.repeats} repeats after 1 warm-up per path; "
                     f"latency: {args.latency_repeats}, interrupts: {args.interrupts} per "
                     "path; PJRT_DEVICE=CPU", packages=f"ray {info.get('ray', '?')}"),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--hosts", type=int, default=2, help="hosts of the cluster (2)")
    parser.add_argument("--per-host", type=int, default=2, help="replicas per host (2)")
    parser.add_argument("--repeats", type=int, default=8, help="trivial-cell runs per path (8)")
    parser.add_argument("--latency-repeats", type=int, default=4,
                        help="first-output runs per path (4)")
    parser.add_argument("--interrupts", type=int, default=3, help="interrupts per path (3)")
    parser.add_argument("--no-one-host", dest="one_host", action="store_false",
                        help="skip the 1-host cluster of hosts*per-host replicas")
    args = parser.parse_args(argv)
    if args.repeats < 2 or args.hosts < 2 or args.per_host < 1 or args.latency_repeats < 1 \
            or args.interrupts < 1:
        parser.error("need --repeats >= 2, --hosts >= 2 (host 1 is the remote one), "
                     "--per-host/--latency-repeats/--interrupts >= 1")
    started = time.perf_counter()
    info = machine_info(args.repeats, 1)
    try:
        import importlib.metadata
        info["ray"] = importlib.metadata.version("ray")
    except Exception:  # noqa: BLE001
        info["ray"] = "missing"
    results = []
    with environ({"PJRT_DEVICE": "CPU"}):
        shapes = [(args.hosts, args.per_host)]
        if args.one_host:
            shapes.append((1, args.hosts * args.per_host))
        for i, (h, n) in enumerate(shapes):
            t0 = time.perf_counter()
            r = measure_cluster(h, n, args, latency=i == 0, interrupts=i == 0)
            results.append(r)
            s = r["trivial_stats_ms"]
            print(f"cluster: {h}x{n}: start {r['start_s']:.1f} s; trivial cluster "
                  f"{s['cluster']['median']:.0f} / one-off {s['one_off']['median']:.0f} ms; "
                  f"left {r['processes_left']} [{time.perf_counter() - t0:.0f} s]",
                  file=sys.stderr)
    seconds = time.perf_counter() - started
    info["notebook_PJRT_DEVICE"] = "CPU"
    return publish(NAME, render(results, info, seconds, args),
                   {"machine": info, "seconds": seconds, "args": vars(args),
                    "results": results}, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
