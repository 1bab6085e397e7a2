"""Warm session (``%xla_session``) against one-off runs: a cell's overhead and the second
training cell.

In one process, for each replica count N (CPU, the default ``processes`` simulation,
PJRT_DEVICE=CPU), a session is started (its start-up timed apart), then, alternating
(the order rotates every iteration, so drift and position effects hit all alike):

1. a trivial cell (``index``): on the warm session (``run_cell(..., session=s)``), as a
   one-off run (``run_cell`` without a session) and the floor, a bare
   ``xmp.spawn(trivial, start_method='fork')`` (launch_overhead.py's own ``bare`` path).
   Medians, p10/p90, and ratios of medians to the session's.
2. tutorial 03's model (notebooks/03-mnist-every-replica.ipynb: ``Net``, SGD with momentum,
   NLLLoss, ``xm.optimizer_step``), K steps on new random data:
   * session: cell 1 defines the model and optimizer, cell 2 trains, then every measured
     cell trains again on new data (the first measured one is the tutorial's "cell 3");
   * one-off: a fresh run that defines and trains in one cell;
   * one-off with ``cache_dir`` (``--cache DIR``): the same, with torch_xla's persistent
     compilation cache, warmed by one untimed run first.
   Wall time of the cell (call to outcome) and, from torch_xla's metrics inside each
   replica, the compilations during the cell (``CompileTime`` count, after minus before;
   a one-off cell counts all of its own) and persistent-cache hits.
   Goal (the issue's): zero recompilations for an unchanged step on the session.
3. a warm cell's way, before and now (issue 35), alternating on the same session: the
   trivial cell and a 17-line plain-Python cell, with each replica compiling the cell
   from its file and a directory made and removed per cell (before: the old ways,
   put back for the measure), and as now (the notebook's compiled cell, marshalled; one
   directory per session, emptied after each cell). Medians, ratio, and the paired
   differences' median and p10/p90.
4. where a warm trivial cell's CPU goes: the CPU time per cell of the notebook's process
   and of each replica over ``--cpu-cells`` cells (psutil), beside the wall time, and the
   floor of a round trip to N processes here: N forked processes each woken by a byte on
   a pipe to run ``x = 1`` and answer (after the session has stopped).

Writes the "session" section of results.md and results/session.json.

    python bench/session.py [--replicas 1,4,8] [--repeats 6] [--train-repeats 1]
                            [--steps 4] [--batch 32] [--way-repeats 30] [--cpu-cells 300]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (bench_parser, machine_info, machine_line, publish,  # noqa: E402
                      paired, replica_counts, rotated, stats)
from launch_overhead import _cell, _signed, make_paths  # noqa: E402

from colab_xla.notebook import state  # noqa: E402
from colab_xla.notebook.launch import environ  # noqa: E402
from colab_xla.notebook.targets import run_cell, start_session, stop_session  # noqa: E402
from colab_xla.notebook.targets import session as session_target  # noqa: E402
from colab_xla.notebook.targets.session import SessionOptions  # noqa: E402
from colab_xla.wire.cell import CellModule  # noqa: E402

NAME = "session"
TRIVIAL = ("session", "one_off", "bare")
TRAIN = ("session", "one_off", "cached")
WAYS = ("before", "now")
# A cell of plain Python with a function and a class (the way's cost grows with the cell:
# each replica compiled it).
PLAIN_CELL = '''import math, statistics
def loss(xs, w):
    total = 0.0
    for x in xs:
        total += (w * x - 1.0) ** 2
    return total / len(xs)
class Model:
    def __init__(self, w):
        self.w = w
    def step(self, xs, lr=0.1):
        g = sum(2 * (self.w * x - 1.0) * x for x in xs) / len(xs)
        self.w -= lr * g
        return loss(xs, self.w)
m = Model(0.5 + index)
xs = [0.1 * i for i in range(4)]
m.step(xs) > 0
'''
WAY_CELLS = {"trivial": "index", "17 lines": PLAIN_CELL}

# Tutorial 03's model, optimizer and loss (cell 1 on a session).
DEFINE_CELL = '''
import copy, time
import torch, torch.nn as nn, torch.nn.functional as F
import torch_xla, torch_xla.core.xla_model as xm, torch_xla.debug.metrics as met


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=5)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


torch.manual_seed(0)
model = Net().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
loss_fn = nn.NLLLoss()
rounds = 0
'''

# K steps on new data; the cell's value: (compilations, persistent-cache hits, entries
# found but not loadable, seconds) during the cell, in this replica.
TRAIN_CELL = '''
def _compiles():
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _counter(name):
    return met.counter_value(name) or 0


compiles0 = _compiles()
hits0, failures0 = _counter("PersistentCacheHit"), _counter("PersistentCacheDeserializeFailure")
rounds += 1
torch.manual_seed(1000 * rounds + index)  # new data, every cell and replica its own
t0 = time.perf_counter()
model.train()
for step in range(STEPS):
    x = torch.randn(BATCH, 1, 28, 28).to(device)
    y = torch.randint(0, 10, (BATCH,)).to(device)
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    xm.optimizer_step(optimizer)
    torch_xla.sync()
loss.item()
(_compiles() - compiles0, _counter("PersistentCacheHit") - hits0,
 _counter("PersistentCacheDeserializeFailure") - failures0, time.perf_counter() - t0)
'''


def _check(outcome, what: str):
    if outcome.failed or not outcome.ok:
        errors = {i: r.error for i, r in outcome.replicas.items() if r.error}
        raise RuntimeError(f"{what}: failed: {errors} {getattr(outcome, 'session_ended', '')}")
    return outcome


def trivial_paths(n: int, session) -> Dict[str, Callable[[], float]]:
    """Each runs the trivial cell once and returns its wall time in seconds."""
    expected = {i: i for i in range(n)}
    bare = make_paths(n)["bare"]

    def timed(**kw) -> float:
        t0 = time.perf_counter()
        outcome = run_cell("index", announce=None, **kw)
        elapsed = time.perf_counter() - t0
        if _check(outcome, f"trivial {kw}").results() != expected:
            raise RuntimeError(f"N={n}: results {outcome.results()}")
        return elapsed

    return {"session": lambda: timed(session=session),
            "one_off": lambda: timed(replicas=n),
            "bare": bare}


def train_paths(n: int, session, cache_dir: str, steps: int, batch: int):
    """Each runs one training cell; returns (seconds, then per replica: compilations,
    persistent-cache hits, cache entries that failed to load, training seconds)."""
    train = TRAIN_CELL.replace("STEPS", str(steps)).replace("BATCH", str(batch))
    one_off = DEFINE_CELL + train

    def timed(source: str, what: str, **kw):
        t0 = time.perf_counter()
        outcome = _check(run_cell(source, announce=None, timeout=600, **kw), what)
        elapsed = time.perf_counter() - t0
        values = outcome.results()
        if sorted(values) != list(range(n)):
            raise RuntimeError(f"{what} N={n}: results {values}")
        return (elapsed, *([values[i][k] for i in range(n)] for k in range(4)))

    return ({"session": lambda: timed(train, "session", session=session),
             "one_off": lambda: timed(one_off, "one-off", replicas=n),
             "cached": lambda: timed(one_off, "cached", replicas=n, cache_dir=cache_dir)},
            lambda: _check(run_cell(DEFINE_CELL, announce=None, timeout=600, session=session),
                           "define"))


@contextlib.contextmanager
def way(name: str):
    """A warm cell's way through the session: "now", or "before" (the ways this benchmark
    measured them against: each replica read, parsed and compiled the cell's file, and each
    cell had a directory of its own, made and removed)."""
    if name == "now":
        yield
        return
    reduce, cell_dir, empty = CellModule.__reduce__, session_target.Session.cell_dir, \
        session_target._empty
    CellModule.__reduce__ = lambda self: (CellModule.load, (self.path, self.label))
    session_target.Session.cell_dir = lambda self: state.new_work_dir("run-")
    session_target._empty = lambda path: shutil.rmtree(path, ignore_errors=True)
    try:
        yield
    finally:
        CellModule.__reduce__, session_target.Session.cell_dir = reduce, cell_dir
        session_target._empty = empty


def way_samples(n: int, session, repeats: int) -> Dict[str, Dict[str, List[float]]]:
    """ms of each cell of :data:`WAY_CELLS` by each way, alternating (order rotating)."""
    samples = {cell: {w: [] for w in WAYS} for cell in WAY_CELLS}
    expected = {cell: _check(run_cell(source, announce=None, session=session), cell).results()
                for cell, source in WAY_CELLS.items()}
    for i in range(repeats + 1):  # (the first: a warm-up)
        for cell, source in WAY_CELLS.items():
            for name in rotated(WAYS, i):
                with way(name):
                    t0 = time.perf_counter()
                    outcome = run_cell(source, announce=None, session=session)
                    elapsed = (time.perf_counter() - t0) * 1e3
                if _check(outcome, f"{cell}, {name}").results() != expected[cell]:
                    raise RuntimeError(
                        f"{cell}, {name}: {outcome.results()} != {expected[cell]}")
                if i:
                    samples[cell][name].append(elapsed)
    return samples


def cpu_per_cell(session, cells: int) -> Dict[str, object]:
    """CPU ms per warm trivial cell: the notebook's process (every thread) and each of the
    session's replicas (psutil's user + system times, over ``cells`` cells, so their clock
    ticks average out), and the wall ms per cell over the same cells."""
    import psutil

    me = psutil.Process()
    replicas = [psutil.Process(pid) for pid in sorted({rep.pid for rep in
                                                       session.replicas.values()})]

    def cpu(process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    before = [cpu(me)] + [cpu(p) for p in replicas]
    t0 = time.perf_counter()
    for _ in range(cells):
        _check(run_cell("index", announce=None, session=session), "cpu")
    wall = time.perf_counter() - t0
    after = [cpu(me)] + [cpu(p) for p in replicas]
    per = [(a - b) / cells * 1e3 for a, b in zip(after, before)]
    return {"cells": cells, "wall_ms": wall / cells * 1e3, "notebook_ms": per[0],
            "replica_ms": per[1:]}


FLOOR_ROUNDS = 300  # the round trips ipc_floor times


def ipc_floor(n: int, rounds: int = FLOOR_ROUNDS) -> float:
    """Median ms of the least a warm cell's round trip can cost here: ``n`` forked
    processes each woken by a byte on a pipe, running ``x = 1`` and answering with a byte,
    the parent waiting for every answer (no output, no result, no Python of ours)."""
    children = []
    code = compile("x = 1", "<cell>", "exec")  # (before the fork: a child only runs it)
    for _ in range(n):
        cmd_r, cmd_w = os.pipe()
        ans_r, ans_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # (a byte other than "c": leave)
            while os.read(cmd_r, 1) == b"c":
                exec(code, {})
                os.write(ans_w, b"k")
            os._exit(0)
        os.close(cmd_r)
        os.close(ans_w)
        children.append((pid, cmd_w, ans_r))
    ms = []
    try:
        for _ in range(rounds + 20):  # (the first 20: a warm-up)
            t0 = time.perf_counter()
            for _, cmd_w, _ in children:
                os.write(cmd_w, b"c")
            for _, _, ans_r in children:
                os.read(ans_r, 1)
            ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        for pid, cmd_w, ans_r in children:
            os.write(cmd_w, b"q")
            os.close(cmd_w)
        for pid, _, ans_r in children:
            os.waitpid(pid, 0)
            os.close(ans_r)
    return statistics.median(ms[20:])


def measure(n: int, repeats: int, train_repeats: int, steps: int, batch: int,
            way_repeats: int, cpu_cells: int) -> dict:
    t0 = time.perf_counter()
    session = start_session(SessionOptions(replicas=n), {}, announce=None)
    start_s = time.perf_counter() - t0
    cache_dir = tempfile.mkdtemp(prefix="colab_xla-bench-cache-")
    try:
        trivial = trivial_paths(n, session)
        for name in TRIVIAL:  # warm-up
            trivial[name]()
        samples: Dict[str, List[float]] = {name: [] for name in TRIVIAL}
        for i in range(repeats):
            for name in rotated(TRIVIAL, i):
                samples[name].append(trivial[name]() * 1e3)
        ways = way_samples(n, session, way_repeats)
        cpu = cpu_per_cell(session, cpu_cells)

        train, define = train_paths(n, session, cache_dir, steps, batch)
        define()
        setup = {"session_cell2": train["session"](), "cache_warm": train["cached"]()}
        runs: Dict[str, list] = {name: [] for name in TRAIN}
        for i in range(train_repeats):
            for name in rotated(TRAIN, i):
                runs[name].append(train[name]())
        cells_run = session.cells_run
    finally:
        stop_session()
        shutil.rmtree(cache_dir, ignore_errors=True)

    medians = {name: stats(samples[name])["median"] for name in TRIVIAL}
    train_ms = {name: [r[0] * 1e3 for r in runs[name]] for name in TRAIN}
    return {
        "replicas": n, "session_start_s": start_s, "session_cells_run": cells_run,
        "trivial_samples_ms": samples,
        "trivial_stats_ms": {name: stats(samples[name]) for name in TRIVIAL},
        "trivial_ratio_to_session": {name: medians[name] / medians["session"]
                                     for name in TRIVIAL},
        "way_samples_ms": ways,
        "cpu_per_cell": cpu, "ipc_floor_ms": ipc_floor(n), "ipc_floor_rounds": FLOOR_ROUNDS,
        "train_setup": {k: {"ms": v[0] * 1e3, "compiles": v[1], "cache_hits": v[2],
                            "cache_load_failures": v[3], "in_replica_s": v[4]}
                        for k, v in setup.items()},
        "train_ms": train_ms,
        "train_median_ms": {name: statistics.median(train_ms[name]) for name in TRAIN},
        "train_compiles": {name: [r[1] for r in runs[name]] for name in TRAIN},
        "train_cache_hits": {name: [r[2] for r in runs[name]] for name in TRAIN},
        "train_cache_load_failures": {name: [r[3] for r in runs[name]] for name in TRAIN},
        "train_in_replica_s": {name: [r[4] for r in runs[name]] for name in TRAIN},
    }


def _counts(per_run: List[List[int]]) -> str:
    """Compilations per replica over the runs: "0" if all alike, else "min–max"."""
    flat = [c for run in per_run for c in run]
    return f"{min(flat)}" if min(flat) == max(flat) else f"{min(flat)}–{max(flat)}"


def render(results: List[dict], info: dict, seconds: float, args) -> str:
    session_compiles = [c for r in results for run in r["train_compiles"]["session"]
                        for c in run]
    goal = ("**met**: no compilation in any measured session cell, on any replica"
            if not any(session_compiles) else
            f"**not met**: up to {max(session_compiles)} compilations in a session cell")
    lines = [
        "## Warm session (%xla_session)",
        "",
        "`run_cell` on a session started once (`start_session(SessionOptions(replicas=N))`, "
        "default `processes` simulation) against one-off runs, interleaved in one process "
        "(the order rotates each iteration).",
        "",
        "A cell's overhead: the trivial cell `index` on the warm session, as a one-off "
        "`run_cell`, and bare `xmp.spawn(trivial, start_method='fork')` (launch_overhead's "
        "floor; on CPU it is one forked process running N replica threads, "
        "CPU_NUM_DEVICES=N). ms, median (p10–p90); ratio: median over the session's median. "
        "Session start: `start_session` until every replica is ready (forks of this warm "
        "process; the first count includes importing torch_xla here, and a replica's XLA "
        "runtime starts with its first use of `device`, in cell 2 below).",
        "",
        "| replicas | session start s | session ms | one-off ms | one-off / session "
        "| bare xmp.spawn ms | bare / session |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s, q = r["trivial_stats_ms"], r["trivial_ratio_to_session"]
        lines.append(f"| {r['replicas']} | {r['session_start_s']:.1f} | {_cell(s['session'])} "
                     f"| {_cell(s['one_off'])} | {q['one_off']:.1f}× | {_cell(s['bare'])} "
                     f"| {q['bare']:.1f}× |")
    lines += [
        "",
        f"The second training cell: tutorial 03's model, {args.steps} steps of batch "
        f"{args.batch} per replica on new random data (`xm.optimizer_step`, then "
        "`torch_xla.sync()`). Session: cell 1 defines the model and optimizer, cell 2 "
        "trains (not timed), each measured cell trains again (the first is cell 3). "
        "One-off: a fresh run that defines and trains. Cached: the same with "
        "`cache_dir` (`--cache`), warmed by one untimed run. Wall ms (median of "
        f"{args.train_repeats}); compilations per replica during the cell (torch_xla "
        "`CompileTime` count, after minus before; min–max over replicas and runs), "
        "persistent-cache hits and entries found but not loaded "
        "(`PersistentCacheDeserializeFailure`) likewise.",
        "",
        "| replicas | session ms | one-off ms | cached ms | one-off / session "
        "| cached / session | compiles: session / one-off / cached "
        "| cache hits / load failures (cached) |",
        "|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        m, c = r["train_median_ms"], r["train_compiles"]
        lines.append(
            f"| {r['replicas']} | {m['session']:.0f} | {m['one_off']:.0f} | {m['cached']:.0f} "
            f"| {m['one_off'] / m['session']:.1f}× | {m['cached'] / m['session']:.1f}× "
            f"| {_counts(c['session'])} / {_counts(c['one_off'])} / {_counts(c['cached'])} "
            f"| {_counts(r['train_cache_hits']['cached'])} / "
            f"{_counts(r['train_cache_load_failures']['cached'])} |")
    lines += [
        "",
        "A warm cell's way, before and now (issue 35): the trivial cell and a 17-line cell "
        "of plain Python (a function, a class) on the same session, alternating (order "
        "rotating). *Before*: the ways this was measured against, put back for the "
        "measure: each replica read the cell's file, parsed and compiled it, and each cell "
        "had a directory of its own, made and removed. *Now*: the replicas get the cell as "
        "the notebook compiled it (marshalled), and the session's cells share one "
        "directory, emptied after each. ms, median (p10–p90) of "
        f"{args.way_repeats}; saved: the paired differences (before − now), median (p10–p90).",
        "",
        "| replicas | cell | before ms | now ms | now / before | saved ms |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for cell, by in r["way_samples_ms"].items():
            before, now = stats(by["before"]), stats(by["now"])
            saved = paired(by["before"], by["now"])
            lines.append(f"| {r['replicas']} | {cell} | {_cell(before)} | {_cell(now)} "
                         f"| {now['median'] / before['median']:.2f}× | {_signed(saved)} |")
    floor_rounds = results[0]["ipc_floor_rounds"]  # (this run's: measure always writes it)
    lines += [
        "",
        "Where a warm trivial cell's CPU goes (issue 35's +2 ms over a plain cell at N=8): "
        f"CPU ms per cell over {args.cpu_cells} cells (psutil, user + system), of the "
        "notebook's process (all its threads) and of each replica; *all*: their sum, and "
        "its half (2 cores: the least wall time that much CPU can take); wall: ms per cell "
        "over the same cells. *Floor*: the least a round trip to N processes costs here: "
        "N forked processes each woken by a byte on a pipe, running `x = 1`, answering "
        f"with a byte (median of {floor_rounds}).",
        "",
        "| replicas | notebook CPU | each replica CPU | all CPU (half) | wall | floor |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        c = r["cpu_per_cell"]
        each = c["replica_ms"]
        total = c["notebook_ms"] + sum(each)
        lines.append(f"| {r['replicas']} | {c['notebook_ms']:.2f} | "
                     f"{statistics.median(each):.2f} ({min(each):.2f}–{max(each):.2f}) | "
                     f"{total:.1f} ({total / 2:.1f}) | {c['wall_ms']:.1f} | "
                     f"{r['ipc_floor_ms']:.2f} |")
    cell2 = ", ".join(
        f"N={r['replicas']}: {r['train_setup']['session_cell2']['ms']:.0f} ms, "
        f"{_counts([r['train_setup']['session_cell2']['compiles']])} compilations"
        for r in results)
    hits = [c for r in results for run in r["train_cache_hits"]["cached"] for c in run]
    failed = [c for r in results for run in r["train_cache_load_failures"]["cached"]
              for c in run]
    if not any(hits) and any(failed):
        lines += ["", "The persistent cache gave nothing here: torch_xla on CPU finds the "
                  "warmed entries but cannot load them (`PersistentCacheDeserializeFailure`) "
                  "and compiles again, so the cached run is a one-off run."]
    lines += [
        "",
        f"Session cell 2 (the first training cell, not in the table; per replica): {cell2}.",
        "",
        f"Goal (zero recompilations for an unchanged step on the session): {goal}.",
        "",
        machine_line(info, NAME, seconds,
                     f"trivial cell: {args.repeats} repeats after 1 warm-up per path; "
                     f"training: {args.train_repeats} repeats; PJRT_DEVICE=CPU"),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--replicas", default="1,4,8", help="replica counts (1,4,8)")
    parser.add_argument("--repeats", type=int, default=6, help="trivial-cell runs per path (6)")
    parser.add_argument("--train-repeats", type=int, default=1,
                        help="training cells per path (1: a fresh run compiles for seconds)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per cell (4)")
    parser.add_argument("--batch", type=int, default=32, help="batch per replica (32)")
    parser.add_argument("--way-repeats", type=int, default=30,
                        help="runs of each cell each way, before and now (30)")
    parser.add_argument("--cpu-cells", type=int, default=300,
                        help="trivial cells whose CPU time is measured (300)")
    args = parser.parse_args(argv)
    counts = replica_counts(args.replicas)
    if args.repeats < 2 or args.train_repeats < 1 or args.steps < 1 or args.batch < 1 \
            or args.way_repeats < 1 or args.cpu_cells < 1 or not counts or min(counts) < 1:
        parser.error("need --repeats >= 2, --train-repeats/--steps/--batch/--way-repeats/"
                     "--cpu-cells >= 1 and replica counts >= 1")
    started = time.perf_counter()
    info = machine_info(args.repeats, 1)
    results = []
    with environ({"PJRT_DEVICE": "CPU"}):
        for n in counts:
            t0 = time.perf_counter()
            r = measure(n, args.repeats, args.train_repeats, args.steps, args.batch,
                        args.way_repeats, args.cpu_cells)
            results.append(r)
            s, m = r["trivial_stats_ms"], r["train_median_ms"]
            print(f"session: N={n}: start {r['session_start_s']:.1f} s; trivial "
                  f"session {s['session']['median']:.1f} / one-off {s['one_off']['median']:.1f}"
                  f" / bare {s['bare']['median']:.1f} ms; train session {m['session']:.0f} / "
                  f"one-off {m['one_off']:.0f} / cached {m['cached']:.0f} ms; compiles "
                  f"{r['train_compiles']} [{time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    seconds = time.perf_counter() - started
    info["notebook_PJRT_DEVICE"] = "CPU"
    return publish(NAME, render(results, info, seconds, args),
                   {"machine": info, "seconds": seconds, "args": vars(args),
                    "results": results}, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
