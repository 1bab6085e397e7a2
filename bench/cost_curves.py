"""Cost curves: what a cell costs as the replicas (one host) and the hosts (a local Ray
cluster) grow, drawn as charts, with what a 64-host slice would pay by a fitted line.

In one process (PJRT_DEVICE=CPU, the default ``processes`` simulation), through the
IPython-free core:

1. replicas, for each N (``--replicas``, default 1..64 by doubling): a session of N
   replicas is started (``start_session``, its start-up timed apart), then, alternating
   with a one-off ``run_cell(..., replicas=N)`` (the order rotates every iteration):
   * cell: the trivial cell ``index``, wall ms (call to outcome);
   * first line: ``print(index)`` as the cell, from the call until a :class:`RunObserver`
     sees the first output line (``bench/cluster.py``'s ``first_output_once``);
   * interrupt: a cell that prints, then ``time.sleep(60)`` on every replica; 0.2 s after
     every replica printed, a timer thread sends SIGINT to this process (``run_cell`` holds
     it as a flag: the notebook's Interrupt; ``bench/cluster.py``'s ``Interrupter``); ms
     from the signal until the call returns with ``outcome.interrupted``, and until every
     replica of a one-off run is gone (a session's must stay up).
   The session is stopped before the next N.
2. hosts, for each H (``--hosts``, default 1, 2, 4, 8): one local Ray cluster of max(H)
   nodes (``LocalCluster``, what ``cluster.start_local`` starts: a Ray head and a node per
   host on 127.0.0.1) is started once; for each H this process connects to H of its nodes
   (``cluster.connect``: an agent per host, ``%xla_cluster connect``'s path) with
   ``--per-host`` replicas each and measures the same three for a one-off cell on every
   host (``run_on_cluster``), then starts a session on every host
   (``ClusterSession.start``) and measures them for cells on it (one phase after the
   other: while a session is up, a host's agent runs every cell on it); first line: of
   any host, and when every host's first line had come. Each connection is
   stopped after its H, the cluster at the end (``finally``), and the processes they
   started are checked.

Per measure: median, p10/p90. A least-squares line ``cost = a + b * hosts`` (numpy) through
each measure's medians over H gives the per-host cost, and what a 64-host slice (v5e-256:
64 hosts x 4 chips) would pay per cell by that line: an extrapolation from one machine
where every "host" shares the same cores.

Charts (matplotlib, Agg): ``results/cost_curves-replicas.png`` and
``results/cost_curves-hosts.png``, shown in the section. Writes the "cost_curves" section
of results.md and results/cost_curves.json.

    python bench/cost_curves.py [--replicas 1,2,4,8,16,32,64] [--repeats 3]
                                [--latency-repeats 2] [--interrupts 2] [--hosts 1,2,4,8]
                                [--per-host 2] [--host-repeats 3] [--host-latency-repeats 2]
                                [--host-interrupts 2] [--slice-hosts 64]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import psutil

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import cluster as cluster_bench  # noqa: E402  (bench/cluster.py: its helpers)
from _results import (alive, bench_parser, machine_info, machine_line,  # noqa: E402
                      publish, replica_counts, rotated, stats)
from cluster import HANG_S, SIGNAL_DELAY_S, Interrupter, first_output_once  # noqa: E402

from colab_xla.notebook import cluster as xla_cluster  # noqa: E402
from colab_xla.notebook.launch import environ  # noqa: E402
from colab_xla.notebook.targets import run_cell, start_session, stop_session  # noqa: E402
from colab_xla.notebook.targets.cluster_one_off import run_on_cluster  # noqa: E402
from colab_xla.notebook.targets.session import SessionOptions  # noqa: E402

NAME = "cost_curves"
PATHS = ("one_off", "session")
LABELS = {"one_off": "one-off", "session": "session"}
MEASURES = ("cell", "first_line", "interrupt")
MEASURE_LABELS = {"cell": "trivial cell", "first_line": "first line",
                  "interrupt": "interrupt → return"}
TRIVIAL_CELL = "index"
FIRST_LINE_CELL = "print(index, flush=True)\nindex"
SLEEP_CELL = "import time\nprint('ready', index, flush=True)\ntime.sleep(60)\n"
GONE_WAIT_S = 5.0  # how long a one-off run's replicas still alive at its return are awaited
SLICE = "v5e-256"  # 64 hosts x 4 chips
SLICE_CHIPS_PER_HOST = 4

# The untimed first cell of a path: on a cluster, every host's agent warms its forkserver
# (imports torch and torch_xla) in it, all at once on these cores: tens of seconds at 8 hosts.
WARM_UP_S = 300.0

Run = Callable[..., object]  # run(source, observer=None, timeout=HANG_S) -> RunOutcome


# -- the measures, on any pair of paths -----------------------------------------------------


def trivial_ms(run: Run, expected: Dict[int, int], what: str,
               timeout: float = HANG_S) -> Optional[float]:
    """The trivial cell once: wall ms; None if it hung (cut by ``timeout``)."""
    t0 = time.perf_counter()
    outcome = run(TRIVIAL_CELL, timeout=timeout)
    elapsed = time.perf_counter() - t0
    if not outcome.ok and elapsed >= timeout * 0.9:
        print(f"cost_curves: {what}: a trivial cell hung; cut after {elapsed:.0f} s",
              file=sys.stderr)
        return None
    if not outcome.ok or outcome.results() != expected:
        errors = {i: r.error for i, r in outcome.replicas.items() if r.error}
        raise RuntimeError(f"{what}: ok={outcome.ok} results={outcome.results()} "
                           f"errors={errors} launch_error={outcome.launch_error} "
                           f"session_ended={getattr(outcome, 'session_ended', None)}")
    return elapsed * 1e3


def interrupt_once(run: Run, total: int, keeps: bool) -> dict:
    """SLEEP_CELL on every replica, SIGINT once all printed (``cluster.Interrupter``): ms
    from the signal to the call's return, and until every replica is gone. ``keeps``: a
    session's replicas, which stay up."""
    observer = Interrupter(total)
    outcome = run(SLEEP_CELL, observer)
    returned = time.monotonic()
    if observer.timer is not None:
        observer.timer.join()
    if observer.signal_at is None:
        if outcome.ok:
            raise RuntimeError(f"interrupt: the run ended before the signal: {outcome.replicas}")
        return {"hung": True, "printed": len(observer.printed)}
    pids = [r.pid for r in outcome.replicas.values() if r.pid]
    left = [] if keeps else alive(pids)
    gone_at, still = returned, left
    end = time.monotonic() + GONE_WAIT_S
    while still and time.monotonic() < end:  # killed, still exiting: until they are gone
        time.sleep(0.005)
        still = alive(still)
        gone_at = time.monotonic()
    return {"hung": False, "ms": (returned - observer.signal_at) * 1e3,
            "clean_ms": None if still else (gone_at - observer.signal_at) * 1e3,
            "interrupted": bool(outcome.interrupted),
            "states": sorted({r.state for r in outcome.replicas.values()}),
            "left_at_return": left, "left_after_wait": still}


def measure_paths(paths: Dict[str, Run], total: int, repeats: int, latency_repeats: int,
                  interrupts: int, what: str, keeps: Dict[str, bool],
                  phases: Sequence[Sequence[str]] = (PATHS,),
                  enter: Optional[Callable[[Sequence[str]], None]] = None) -> dict:
    """The three measures on the paths, phase by phase (``enter(phase)`` first); within a
    phase each measure alternates between its paths (the order rotates every iteration),
    after one untimed trivial cell per path."""
    expected = {i: i for i in range(total)}
    hung = {name: 0 for name in PATHS}
    cell: Dict[str, List[float]] = {name: [] for name in PATHS}
    first: Dict[str, List[Dict[int, float]]] = {name: [] for name in PATHS}
    cut: Dict[str, List[dict]] = {name: [] for name in PATHS}
    warm_up: Dict[str, Optional[float]] = {}
    for phase in phases:
        if enter is not None:
            enter(phase)
        for name in phase:  # warm-up
            warm_up[name] = trivial_ms(paths[name], expected, f"{what} {name} warm-up",
                                       WARM_UP_S)
        for i in range(repeats):
            for name in rotated(phase, i):
                ms = trivial_ms(paths[name], expected, f"{what} {name}")
                if ms is None:
                    hung[name] += 1
                else:
                    cell[name].append(ms)
        for i in range(latency_repeats):
            for name in rotated(phase, i):
                got = first_output_once(lambda obs, run=paths[name]: run(FIRST_LINE_CELL, obs))
                if got is None:
                    hung[name] += 1
                else:
                    first[name].append(got)
        for i in range(interrupts):
            for name in rotated(phase, i):
                got = interrupt_once(paths[name], total, keeps[name])
                hung[name] += got["hung"]
                cut[name].append(got)
    samples = {
        "cell": cell,
        "first_line": {name: [min(run.values()) for run in first[name] if run]
                       for name in PATHS},
        "every_host_first_line": {name: [max(run.values()) for run in first[name] if run]
                                  for name in PATHS},
        "interrupt": {name: [run["ms"] for run in cut[name] if not run["hung"]]
                      for name in PATHS},
        "interrupt_clean": {name: [run["clean_ms"] for run in cut[name]
                                   if not run["hung"] and run["clean_ms"] is not None]
                            for name in PATHS},
    }
    return {"hung": hung, "samples_ms": samples, "warm_up_ms": warm_up,
            "stats_ms": {m: {name: stats(s[name]) for name in PATHS}
                         for m, s in samples.items()},
            "first_line_by_host_ms": first, "interrupts": cut}


def _available_gib() -> float:
    return psutil.virtual_memory().available / 2**30


def _median(s: Optional[dict]) -> Optional[float]:
    return None if s is None else s["median"]


def _progress(what: str, r: dict, seconds: float) -> None:
    s = r["stats_ms"]
    print(f"cost_curves: {what}; " + "; ".join(
        f"{m} " + " / ".join(f"{name} {_median(s[m][name]) or 0:.0f}" for name in PATHS)
        for m in MEASURES) + f" ms; {r['available_gib_session_up']:.1f} GiB free "
        f"[{seconds:.0f} s]", file=sys.stderr)


# -- replicas on this machine ---------------------------------------------------------------


def measure_replicas(n: int, args) -> dict:
    t0 = time.perf_counter()
    session = start_session(SessionOptions(replicas=n), {}, announce=None)
    start_s = time.perf_counter() - t0
    pids = [rep.pid for rep in session.replicas.values()]
    available = _available_gib()
    try:
        paths = {
            "one_off": lambda source, observer=None, timeout=HANG_S: run_cell(
                source, replicas=n, announce=None, observer=observer, timeout=timeout),
            "session": lambda source, observer=None, timeout=HANG_S: run_cell(
                source, session=session, announce=None, observer=observer, timeout=timeout),
        }
        result = measure_paths(paths, n, args.repeats, args.latency_repeats, args.interrupts,
                               f"N={n}", {"one_off": False, "session": True})
        result["session_up_after"] = session.up
        result["session_cells_run"] = session.cells_run
    finally:
        stop_session()
    result.update({"replicas": n, "session_start_s": start_s,
                   "available_gib_session_up": available,
                   "session_replicas_left": alive(pids)})
    return result


# -- hosts: a local Ray cluster -------------------------------------------------------------


def measure_hosts(address: str, h: int, args, seen: Dict[int, str]) -> dict:
    """H hosts of the local Ray cluster at ``address``: connected (an agent per host), the
    one-off cells measured, then a session started on every host and its cells measured
    (in that order: an agent with a session up runs every cell on it), the connection
    stopped (its session with it)."""
    from colab_xla.notebook.targets.cluster_session import ClusterSession

    per_host = args.per_host
    t0 = time.perf_counter()
    c = xla_cluster.connect(address, hosts=h, replicas=per_host, announce=None)
    connect_s = time.perf_counter() - t0
    up: Dict[str, float] = {}

    def enter(phase) -> None:
        if "session" in phase:
            t = time.perf_counter()
            c.session = ClusterSession.start(c, announce=None)
            up["session_start_s"] = time.perf_counter() - t
            up["available_gib_session_up"] = _available_gib()
        seen.update(cluster_bench._children())

    def run(source, observer=None, timeout=HANG_S):  # every host: its session once up
        return run_on_cluster(c, source, user_ns={}, announce=None, observer=observer,
                              timeout=timeout)

    try:
        result = measure_paths({"one_off": run, "session": run}, h * per_host,
                               args.host_repeats, args.host_latency_repeats,
                               args.host_interrupts, f"{h} hosts",
                               {"one_off": False, "session": True},
                               phases=(("one_off",), ("session",)), enter=enter)
        seen.update(cluster_bench._children())
        result["session_up_after"] = c.session is not None and c.session.up
        result["session_cells_run"] = c.session.cells_run
    finally:
        xla_cluster.stop()  # its session on every host, then the agents
    result.update({"hosts": h, "per_host": per_host, "replicas": h * per_host,
                   "connect_s": connect_s, **up})
    return result


def measure_all_hosts(host_counts: List[int], args) -> dict:
    """One local Ray cluster of max(H) nodes, started once; each H connects to H of its
    nodes. Stopped in a ``finally``; then the processes it and the agents started (children
    of this process seen while they were up) are checked."""
    from colab_xla.notebook.cluster.connection import import_ray
    from colab_xla.notebook.cluster.local import LocalCluster, local_addresses

    local_addresses()  # as cluster.start_local does: everything on 127.0.0.1
    import_ray()
    t0 = time.perf_counter()
    local = LocalCluster(max(host_counts))
    nodes_start_s = time.perf_counter() - t0
    print(f"cost_curves: a local Ray cluster of {max(host_counts)} nodes started in "
          f"{nodes_start_s:.0f} s", file=sys.stderr)
    seen: Dict[int, str] = {}
    results = []
    try:
        seen.update(cluster_bench._children())
        for h in host_counts:
            t0 = time.perf_counter()
            r = measure_hosts(local.address, h, args, seen)
            results.append(r)
            _progress(f"{h} hosts x {args.per_host}: connect {r['connect_s']:.1f} s, session "
                      f"{r['session_start_s']:.1f} s", r, time.perf_counter() - t0)
    finally:
        xla_cluster.stop()  # (a connection a failure left up)
        local.shutdown()
    time.sleep(2.0)  # Ray's node processes end shortly after shutdown
    return {"nodes": max(host_counts), "nodes_start_s": nodes_start_s, "results": results,
            "processes_seen": len(seen),
            "processes_left": {pid: seen[pid] for pid in alive(list(seen))}}


# -- the fit, the charts, the text ----------------------------------------------------------


def fit_line(xs: Sequence[float], ys: Sequence[Optional[float]]) -> Optional[Dict[str, float]]:
    """Least squares ``y = a + b * x`` (None values left out): a, b, r², points; None with
    fewer than two distinct x."""
    import numpy as np

    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if len({x for x, _ in pairs}) < 2:
        return None
    x = np.array([p[0] for p in pairs], dtype=float)
    y = np.array([p[1] for p in pairs], dtype=float)
    (a, b), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), y, rcond=None)
    spread = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - (a + b * x)) ** 2).sum()) / spread if spread > 0 else 1.0
    return {"a": float(a), "b": float(b), "r2": r2, "points": len(pairs)}


def fits(results: List[dict], key: str, at: float) -> Dict[str, Dict[str, Optional[dict]]]:
    """Per measure and path, the line through the medians over ``key`` ("hosts",
    "replicas"), and its value at ``at``."""
    out: Dict[str, Dict[str, Optional[dict]]] = {}
    for m in MEASURES:
        out[m] = {}
        for name in PATHS:
            f = fit_line([r[key] for r in results],
                         [_median(r["stats_ms"][m][name]) for r in results])
            if f is not None:
                f["at"], f["value_at"] = at, f["a"] + f["b"] * at
            out[m][name] = f
    return out


def chart_paths(out_dir: str) -> Dict[str, str]:
    return {kind: os.path.join(out_dir, "results", f"{NAME}-{kind}.png")
            for kind in ("replicas", "hosts")}


def draw_charts(replicas: List[dict], hosts: List[dict], host_fits, out_dir: str,
                per_host: int, cores: int) -> Dict[str, str]:
    """The PNG charts of the parts measured; their paths by kind."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    colors = {"one_off": "tab:orange", "session": "tab:blue"}
    paths = chart_paths(out_dir)
    os.makedirs(os.path.dirname(paths["replicas"]), exist_ok=True)
    drawn = {}
    for kind, results, key in (("replicas", replicas, "replicas"), ("hosts", hosts, "hosts")):
        if not results:
            continue
        fig, axes = plt.subplots(1, len(MEASURES), figsize=(13, 4.2), constrained_layout=True)
        xs_all = sorted({r[key] for r in results})
        for ax, m in zip(axes, MEASURES):
            for name in PATHS:
                rows = [(r[key], r["stats_ms"][m][name]) for r in results
                        if r["stats_ms"][m][name] is not None]
                if not rows:
                    continue
                xs = [x for x, _ in rows]
                med = [s["median"] for _, s in rows]
                err = [[s["median"] - s["p10"] for _, s in rows],
                       [s["p90"] - s["median"] for _, s in rows]]
                ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, color=colors[name],
                            label=LABELS[name])
                fit = host_fits[m][name] if kind == "hosts" else None
                if fit is not None:
                    ends = [min(xs), max(xs)]
                    ax.plot(ends, [fit["a"] + fit["b"] * x for x in ends], "--",
                            color=colors[name], alpha=0.6,
                            label=f"fit {fit['a']:.0f} + {fit['b']:.1f}·hosts")
            ax.set_title(MEASURE_LABELS[m])
            ax.set_ylabel("ms (median, p10–p90)")
            ax.grid(True, which="both", alpha=0.3)
            if kind == "replicas":
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(NullFormatter())
                ax.set_xlabel("replicas N on one host (log2)")
            else:
                ax.set_xlabel(f"hosts ({per_host} replicas each)")
                ax.set_ylim(bottom=0)
            ax.set_xticks(xs_all)
            ax.set_xticklabels([str(x) for x in xs_all])
            ax.legend(fontsize=8)
        fig.suptitle("A cell's cost by replicas (one host, one-off run vs session)"
                     if kind == "replicas" else
                     f"A cell's cost by hosts (local Ray cluster on one {cores}-core machine)")
        fig.savefig(paths[kind], dpi=100)
        plt.close(fig)
        drawn[kind] = paths[kind]
    return drawn


def _cell(s: Optional[Dict[str, float]]) -> str:
    if s is None:
        return "–"
    return f"{s['median']:.0f} ({s['p10']:.0f}–{s['p90']:.0f})"


def _table(results: List[dict], key: str, header: str, extra: Sequence[tuple]) -> List[str]:
    """A row per replica/host count: each measure x path, then the extra columns."""
    heads = [f"{MEASURE_LABELS[m]}: {LABELS[name]}" for m in MEASURES for name in PATHS]
    heads += [h for h, _ in extra]
    lines = [f"| {header} | " + " | ".join(heads) + " |", "|---:|" + "---:|" * len(heads)]
    for r in results:
        cols = [_cell(r["stats_ms"][m][name]) for m in MEASURES for name in PATHS]
        cols += [fn(r) for _, fn in extra]
        lines.append(f"| {r[key]} | " + " | ".join(cols) + " |")
    return lines


def _troubles(results: List[dict], key: str) -> List[str]:
    """What went wrong, said: hung runs, runs not interrupted, replicas that outlived
    the wait, a session that ended."""
    said = []
    for r in results:
        where = f"{r[key]} {key}"
        hung = {name: k for name, k in r["hung"].items() if k}
        if hung:
            said.append(f"{where}: hung runs (cut by `timeout={HANG_S:g}`, left out): "
                        + ", ".join(f"{LABELS[n]} {k}" for n, k in hung.items()))
        for name in PATHS:
            runs = [x for x in r["interrupts"][name] if not x["hung"]]
            if any(not x["interrupted"] for x in runs):
                said.append(f"{where}: {LABELS[name]}: "
                            f"{sum(not x['interrupted'] for x in runs)} interrupted runs "
                            "without `outcome.interrupted`")
            outlived = sum(len(x["left_after_wait"]) for x in runs)
            if outlived:
                said.append(f"{where}: {LABELS[name]}: {outlived} replicas still alive "
                            f"{GONE_WAIT_S:g} s after an interrupted call returned")
        if not r["session_up_after"]:
            said.append(f"{where}: the session had ended after its interrupts")
        if r.get("session_replicas_left"):
            said.append(f"{where}: session replicas alive after `stop_session()`: "
                        f"{r['session_replicas_left']}")
    return said


def _left_at_return(results: List[dict]) -> str:
    """A sentence: whether interrupted one-off runs returned with replicas still exiting,
    and the median ms from the signal until the last was gone."""
    runs = [x for r in results for x in r["interrupts"]["one_off"] if not x["hung"]]
    late = [x for x in runs if x["left_at_return"]]
    if not late:
        return (f"Every interrupted one-off run's replicas were gone when its call returned "
                f"({len(runs)} interrupts).")
    clean = [x["clean_ms"] for x in runs if x["clean_ms"] is not None]
    gone = (f"; from the signal until every replica was gone: median "
            f"{stats(clean)['median']:.0f} ms (return: "
            f"{stats([x['ms'] for x in runs])['median']:.0f} ms)" if clean else "")
    return (f"{len(late)} of {len(runs)} interrupted one-off runs returned while some of "
            f"their replicas (killed) were still exiting{gone}.")


def render(replicas: List[dict], cluster_run: Optional[dict], info: dict, seconds: float,
           args, charts: Dict[str, str], no_hosts: Optional[str] = None) -> str:
    """The section's text. ``cluster_run``: :func:`measure_all_hosts`'s (None: not
    measured, ``no_hosts`` says why); ``charts``: the PNGs drawn, by kind."""
    hosts = cluster_run["results"] if cluster_run else []
    cores = info["cores_usable"] or info["cores"]
    lines = [
        "## Cost curves: replicas and hosts",
        "",
        "What a cell costs as the replicas of one host and the hosts of a cluster grow, "
        "through the IPython-free core, in one process: a one-off run (replicas started for "
        "the cell) against a warm session. "
        "ms, median (p10–p90). **Trivial cell**: `index`, call to outcome. **First line**: "
        "cell `print(index)`, from the call until a `RunObserver` sees the first output "
        "line (a one-off run's includes starting its replicas). **Interrupt → return**: a "
        "cell that prints, then `time.sleep(60)` on every replica; "
        f"{SIGNAL_DELAY_S:g} s after every replica printed, SIGINT to this process (the "
        "notebook's Interrupt), ms from the signal until the call returns with "
        "`outcome.interrupted` (a session's replicas stay up).",
        "",
        "### Replicas on one host",
        "",
        "`run_cell(..., replicas=N)` against a cell on a session of N replicas "
        "(`start_session`, started once per N, stopped before the next), alternating (the "
        "order rotates each iteration), default "
        f"`processes` simulation (a process per replica), PJRT_DEVICE=CPU; {args.repeats} "
        f"trivial cells, {args.latency_repeats} first lines, {args.interrupts} interrupts "
        "per path and N, after one untimed cell per path. Session start: until its N "
        "replicas were ready. GiB free: memory available on the machine while the "
        "session was up.",
        "",
    ]
    if "replicas" in charts:
        lines += ["![A cell's cost by replicas](results/cost_curves-replicas.png)", ""]
    lines += _table(replicas, "replicas", "N", (
        ("session start s", lambda r: f"{r['session_start_s']:.1f}"),
        ("GiB free", lambda r: f"{r['available_gib_session_up']:.1f}")))
    rep_fits = fits(replicas, "replicas", max((r["replicas"] for r in replicas), default=1))
    slopes = [f"{MEASURE_LABELS[m]} one-off {f['one_off']['b']:+.1f}, session "
              f"{f['session']['b']:+.1f}" for m, f in rep_fits.items()
              if f["one_off"] is not None and f["session"] is not None]
    if slopes:
        lines += ["", "Each further replica, by a least-squares line through the medians "
                  "over N (ms per replica): " + "; ".join(slopes) + ". " +
                  _left_at_return(replicas)]

    lines += ["", "### Hosts: a local Ray cluster", ""]
    if not hosts:
        lines += [f"Not measured: {no_hosts or 'no host counts given (--hosts)'}."]
    else:
        per_host = hosts[0]["per_host"]
        lines += [
            f"One local Ray cluster of {cluster_run['nodes']} nodes on 127.0.0.1 (what "
            "`cluster.start_local` starts), started once "
            f"({cluster_run['nodes_start_s']:.0f} s); for each H, this process connects "
            f"to H of its nodes (`cluster.connect(address, hosts=H, replicas={per_host})`: "
            "an agent per host, which imports torch_xla); one-off cells on every host "
            "(`run_on_cluster`, each agent starting its replicas from its warm forkserver) are "
            "measured first, then a session is started on every host (`ClusterSession.start`) "
            "and cells on it are measured: not alternating, since a host's agent runs every "
            "cell on its session while one is up (the core has no way to run a one-off cell "
            "on the hosts beside a session). "
            f"{args.host_repeats} trivial cells, {args.host_latency_repeats} first lines, "
            f"{args.host_interrupts} interrupts per path and H, after one untimed cell per "
            "path. First one-off cell: that untimed cell (each agent warms its forkserver in "
            "it: imports torch and torch_xla). First line: of any host; every host's: when "
            "the last host's first line came. The cluster's other nodes idle meanwhile. "
            "Every host is a Ray node on this machine: they share its "
            f"{cores} cores, and no network lies between them.",
            "",
        ]
        if "hosts" in charts:
            lines += ["![A cell's cost by hosts](results/cost_curves-hosts.png)", ""]
        lines += _table(hosts, "hosts", "H", (
            ("every host's first line: one-off / session", lambda r: " / ".join(
                f"{_median(r['stats_ms']['every_host_first_line'][name]) or 0:.0f}"
                for name in PATHS)),
            ("connect s", lambda r: f"{r['connect_s']:.1f}"),
            ("first one-off cell s", lambda r: "–" if r["warm_up_ms"].get("one_off") is None
             else f"{r['warm_up_ms']['one_off'] / 1e3:.1f}"),
            ("session start s", lambda r: f"{r['session_start_s']:.1f}"),
            ("GiB free", lambda r: f"{r['available_gib_session_up']:.1f}")))
        lines += ["", _left_at_return(hosts)]
        lines += _extrapolated(hosts, args.slice_hosts, per_host, cores)
        left = cluster_run["processes_left"]
        lines += ["", ("Processes left after the cluster was stopped (2 s later): none of "
                       f"the {cluster_run['processes_seen']} it and its agents started."
                       if not left else
                       f"Processes left after the cluster was stopped (2 s later): {len(left)} "
                       f"of {cluster_run['processes_seen']}: " + "; ".join(
                           f"{pid} `{cmd}`" for pid, cmd in sorted(left.items())) + ".")]
    troubles = _troubles(replicas, "replicas") + _troubles(hosts, "hosts")
    lines += ["", ("Every interrupted call returned with `outcome.interrupted`, every session "
                   "was up after its interrupts, nothing was left after the sessions were "
                   "stopped, no run hung." if not troubles else
                   "Problems: " + "; ".join(troubles) + ".")]
    lines += [
        "",
        machine_line(info, NAME, seconds,
                     f"{info['memory_gib']:.0f} GiB memory; replicas {args.replicas}; hosts "
                     f"{args.hosts} × {args.per_host}; PJRT_DEVICE=CPU",
                     packages=f"ray {info.get('ray', '?')}, matplotlib "
                              f"{info.get('matplotlib', '?')}"),
    ]
    return "\n".join(lines)


def _extrapolated(hosts: List[dict], slice_hosts: int, per_host: int, cores) -> List[str]:
    """The per-host lines and what a slice of ``slice_hosts`` hosts would pay by them."""
    host_fits = fits(hosts, "hosts", slice_hosts)
    rows = [(m, name, host_fits[m][name]) for m in MEASURES for name in PATHS
            if host_fits[m][name] is not None]
    if not rows:
        return ["", "Per-host cost: needs at least two host counts (`--hosts`)."]
    counts = ", ".join(str(r["hosts"]) for r in hosts)
    lines = [
        "",
        f"Per-host cost: a least-squares line `cost = a + b · hosts` through each measure's "
        f"medians over H = {counts}, and its value at {slice_hosts} hosts: what a {SLICE} "
        f"slice ({slice_hosts} hosts × {SLICE_CHIPS_PER_HOST} chips) would pay per cell **by "
        "this line**.",
        "",
        f"| measure | path | a ms | b ms per host | r² | at {slice_hosts} hosts ({SLICE}) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for m, name, f in rows:
        lines.append(f"| {MEASURE_LABELS[m]} | {LABELS[name]} | {f['a']:.0f} | {f['b']:+.1f} "
                     f"| {f['r2']:.2f} | **{f['value_at'] / 1e3:.2f} s** |")

    def at(m, name):
        f = host_fits[m][name]
        if f is None:
            return "–"
        if f["b"] <= 0:  # noise larger than any rise: no per-host cost to extrapolate
            return f"no more than at {max(r['hosts'] for r in hosts)} hosts (its line falls)"
        return f"{f['value_at'] / 1e3:.2f} s"

    lines += [
        "",
        f"Written out: by these lines, a {SLICE} slice would pay about "
        f"**{at('cell', 'session')}** for a trivial cell on its session and "
        f"**{at('cell', 'one_off')}** for a one-off cell; "
        f"{at('first_line', 'session')} (session) and {at('first_line', 'one_off')} "
        f"(one-off) until the first line; {at('interrupt', 'session')} (session) and "
        f"{at('interrupt', 'one_off')} (one-off) from an Interrupt to the cell's end. This "
        f"is an extrapolation, from {max(r['hosts'] for r in hosts)} hosts to {slice_hosts}, "
        f"measured on one machine where every \"host\" (a Ray node, its agent and its "
        f"{per_host} replicas) shares the same {cores} cores: the slope counts the "
        "notebook's own work per host (a Ray call per host and poll, merging its events) "
        "together with the hosts' work competing for those cores, which on a real slice "
        "runs on each host's own CPUs, at the same time; a "
        f"{SLICE} host runs {SLICE_CHIPS_PER_HOST} replicas, these {per_host}; and there "
        "is no network here. Read it as the order of magnitude of what colab_xla and Ray "
        "add per host, not as a measurement of a pod.",
    ]
    bent = [f"{MEASURE_LABELS[m]} ({LABELS[name]}, r² {f['r2']:.2f})" for m, name, f in rows
            if f["r2"] < 0.9]
    if bent:
        lines[-1] += (" The medians bend away from a line where r² is below 0.9: "
                      + ", ".join(bent) + " (see the chart: likely the rise steepening as the "
                      "hosts' processes come to outnumber the cores).")
    return lines


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--replicas", default="1,2,4,8,16,32,64",
                        help="replica counts on one host (1,2,4,8,16,32,64)")
    parser.add_argument("--repeats", type=int, default=3, help="trivial cells per path and N (3)")
    parser.add_argument("--latency-repeats", type=int, default=2,
                        help="first-line runs per path and N (2)")
    parser.add_argument("--interrupts", type=int, default=2, help="interrupts per path and N (2)")
    parser.add_argument("--hosts", default="1,2,4,8",
                        help="host counts of the local Ray cluster (1,2,4,8; '' for none)")
    parser.add_argument("--per-host", type=int, default=2, help="replicas per host (2)")
    parser.add_argument("--host-repeats", type=int, default=3,
                        help="trivial cells per path and host count (3)")
    parser.add_argument("--host-latency-repeats", type=int, default=2,
                        help="first-line runs per path and host count (2)")
    parser.add_argument("--host-interrupts", type=int, default=2,
                        help="interrupts per path and host count (2)")
    parser.add_argument("--slice-hosts", type=int, default=64,
                        help=f"hosts of the slice the lines are extrapolated to (64: {SLICE})")
    args = parser.parse_args(argv)
    counts, host_counts = replica_counts(args.replicas), replica_counts(args.hosts)
    if not counts or min(counts) < 1 or (host_counts and min(host_counts) < 1) \
            or min(args.per_host, args.repeats, args.latency_repeats, args.interrupts,
                   args.host_repeats, args.host_latency_repeats, args.host_interrupts,
                   args.slice_hosts) < 1:
        parser.error("replica and host counts, repeats and --per-host must be >= 1")
    started = time.perf_counter()
    info = machine_info(args.repeats, 1)
    info["memory_gib"] = psutil.virtual_memory().total / 2**30
    import importlib.metadata
    for dist in ("ray", "matplotlib"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = "missing"
    no_hosts = None
    if host_counts and info["ray"] == "missing":
        no_hosts = "ray is not installed (`pip install colab_xla[ray]`)"
        host_counts = []
    replicas, cluster_run = [], None
    with environ({"PJRT_DEVICE": "CPU"}):
        for n in counts:
            t0 = time.perf_counter()
            r = measure_replicas(n, args)
            replicas.append(r)
            _progress(f"N={n}: session start {r['session_start_s']:.1f} s", r,
                      time.perf_counter() - t0)
        if host_counts:
            cluster_run = measure_all_hosts(host_counts, args)
    hosts = cluster_run["results"] if cluster_run else []
    host_fits = fits(hosts, "hosts", args.slice_hosts)
    charts = draw_charts(replicas, hosts, host_fits, args.out, args.per_host,
                         info["cores_usable"] or info["cores"])
    seconds = time.perf_counter() - started
    info["notebook_PJRT_DEVICE"] = "CPU"
    return publish(NAME, render(replicas, cluster_run, info, seconds, args, charts, no_hosts),
                   {"machine": info, "seconds": seconds, "args": vars(args),
                    "replicas": replicas, "cluster": cluster_run, "host_fits": host_fits,
                    "replica_fits": fits(replicas, "replicas", max(counts)),
                    "charts": {k: os.path.relpath(v, args.out) for k, v in charts.items()}},
                   out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
