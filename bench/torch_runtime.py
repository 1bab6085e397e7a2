"""The torch runtime (``%%xla_spawn --runtime torch -n N``) against a bare
``torch.multiprocessing`` launch (and ``torchrun``) of the same gloo program, on CPU.

In one process (PJRT_DEVICE=CPU; torch imported here, as a notebook that uses torch has it,
so every fork starts with it), for each process count N, the paths run the same program
(the default process group with gloo, one ``dist.all_reduce`` of a 1-element tensor),
interleaved (the order rotates every iteration, so drift and position effects hit all
alike):

1. one-off launch:
   * ``bare fork``: ``torch.multiprocessing.start_processes(bare_job, nprocs=N,
     start_method="fork")`` of a module-level function: ``init_process_group("gloo")``
     with ``env://`` (MASTER_ADDR/MASTER_PORT set around the call, a free port per run),
     the all_reduce, ``destroy_process_group()``;
   * ``%%xla_spawn``: ``%%xla_spawn --runtime torch -n N --no-widget`` of the cell doing
     the all_reduce, in a real IPython shell (its printed output goes to a StringIO);
   * ``core``: ``run_cell(cell, replicas=N, launch=Launch(runtime="torch"))``, no IPython;
   * in the first ``--slow-repeats`` iterations only (each child imports torch): the same
     function by ``torch.multiprocessing.spawn`` (start method ``spawn``), and ``torchrun
     --nproc-per-node N`` (the venv's) of a script file doing the same.
   Wall time of the call; a timeline (ms from the call until the last process reached
   each point): forked, ready (about to make the group: torch imported; colab_xla: the
   replica set up and the cell's globals made, ``before_cell`` entered), group made,
   all_reduce done, group destroyed; and the CPU time of this process and of its children.
   The bare paths stamp these themselves; in colab_xla's replicas, wrappers around the
   replica's entry and the torch runtime's hooks (``before_cell``, which makes the group,
   ``to_host``, ``after_process``), installed in this process before it forks, write
   ``time.perf_counter()`` into shared memory (about a microsecond each). Before torch is
   imported here, ``--cold-replicas`` runs the cell once through ``run_cell`` from this
   torch-free process (as from a notebook that never imported torch).
2. warm cell: a session (``%xla_session start --runtime torch -n N``, timed apart), then
   the cell on it through ``%%xla_spawn --no-widget`` and through ``run_cell(...,
   session=...)``, against the floor: ``bare step``, N processes started once by
   ``torch.multiprocessing`` (fork) with the group made, each told "one step" through a
   pipe, doing the all_reduce and answering with its value. Phases from stamps the cell
   (and the bare step) takes: until the first and the last process started it, the cell,
   collect (the last process's end to the call's return); and the CPU time of this process
   and of the N processes (``/proc/PID/task/*/schedstat``), read around each call.

Medians, p10/p90, ratio of medians and median of paired differences (each iteration's time
minus the bare one's). Goals: a one-off ``%%xla_spawn`` within 1.5x of the bare fork launch
(every N), and a warm cell within 10 ms of the bare step at the largest N (8).
Writes the "torch_runtime" section of results.md and results/torch_runtime.json.

    python bench/torch_runtime.py [--replicas 1,2,4,8] [--repeats 12] [--warm-repeats 30]
                                  [--slow-repeats 2] [--cold-replicas 2] [--out DIR]
"""

# Kept light at the top (stdlib and _results only): a child that torch.multiprocessing
# starts by ``spawn`` imports this file again to find bare_job.
from __future__ import annotations

import ast
import contextlib
import io
import math
import multiprocessing
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (bench_parser, machine_info, machine_line, paired,  # noqa: E402
                      publish, replica_counts, rotated, schedstat_ms, stats)

NAME = "torch_runtime"
LAUNCH_GOAL_RATIO = 1.5  # one-off %%xla_spawn / bare fork launch, every N
WARM_GOAL_MS = 10.0  # warm cell minus the bare step, at the largest N
FAST = ("bare_fork", "magic", "core")
SLOW = ("bare_spawn", "torchrun")
WARM = ("bare_step", "magic", "core")
LABELS = {"bare_fork": "bare fork", "bare_spawn": "bare spawn", "torchrun": "torchrun",
          "magic": "%%xla_spawn", "core": "core run_cell", "bare_step": "bare step"}
MILESTONES = ("forked", "ready", "group", "reduced", "destroyed")
MILESTONE_LABELS = ("forked", "ready", "group made", "all_reduce done", "group destroyed")
WARM_PHASES = ("first starts", "last starts", "cell", "collect")
STORE_RETRY_MS = 250.0  # a group made this long after its processes were ready: a retry
MAX_PROCESSES = 16  # colab_xla's own limit on CPU
HANG_S = 300

# The cell: its value is the reduced sum (N) and when the cell started and ended here.
CELL = ("import time, torch, torch.distributed as dist\n"
        "_t0 = time.perf_counter()\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "(t.item(), _t0, time.perf_counter())")

# The torchrun script: the same program; it prints its stamps (CLOCK_MONOTONIC is one clock
# for every process of the machine: perf_counter on Linux).
TORCHRUN_SCRIPT = '''\
import time
_stamps = [time.perf_counter()]
import os, torch, torch.distributed as dist
_stamps.append(time.perf_counter())
dist.init_process_group("gloo")
_stamps.append(time.perf_counter())
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size(), t
_stamps.append(time.perf_counter())
dist.destroy_process_group()
_stamps.append(time.perf_counter())
# One write (a pipe's writes up to 4 KiB are atomic): the processes share torchrun's stdout.
os.write(1, " ".join(["STAMPS", os.environ["RANK"], *map(repr, _stamps)]).encode() + b"\\n")
'''

# Where every process writes its stamps: MAX_PROCESSES x MILESTONES doubles of shared memory
# (made in main, before any fork; a spawned child gets it with its arguments).
_STAMPS = None


# --- the bare programs (module level: torch.multiprocessing's spawn finds them by name) ---

def _stamp(stamps, rank: int, milestone: int) -> None:
    if stamps is not None:
        stamps[rank * len(MILESTONES) + milestone] = time.perf_counter()


def _quiet_stdout() -> None:
    """gloo writes a "[Gloo] Rank i is connected to ..." line per process to stdout (in
    colab_xla's replicas, output of the cell's process that reaches the notebook)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)


def bare_job(rank: int, n: int, stamps) -> None:
    """The bare launch's function: what a torch.distributed script does."""
    _stamp(stamps, rank, 0)
    _quiet_stdout()
    import torch
    import torch.distributed as dist

    _stamp(stamps, rank, 1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=n)
    _stamp(stamps, rank, 2)
    t = torch.ones(1)
    dist.all_reduce(t)
    if t.item() != n:
        raise RuntimeError(f"rank {rank}: all_reduce gave {t.item()}, not {n}")
    _stamp(stamps, rank, 3)
    dist.destroy_process_group()
    _stamp(stamps, rank, 4)


def pool_worker(rank: int, n: int, conns) -> None:
    """A process of the bare warm pool: the group made once, then one all_reduce per
    command, answered with (value, start, end); None ends it."""
    _quiet_stdout()
    import torch
    import torch.distributed as dist

    conn = conns[rank]
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=n)
    conn.send("ready")
    while conn.recv() is not None:
        t0 = time.perf_counter()
        t = torch.ones(1)
        dist.all_reduce(t)
        conn.send((t.item(), t0, time.perf_counter()))
    dist.destroy_process_group()


class Pool:
    """N bare processes (torch.multiprocessing, fork) with their group made, waiting for
    steps: the floor a warm cell could reach."""

    def __init__(self, n: int):
        import torch.multiprocessing as tmp

        from colab_xla.notebook.launch import environ, free_port

        ctx = multiprocessing.get_context("fork")
        pairs = [ctx.Pipe() for _ in range(n)]
        self.conns = [mine for mine, _ in pairs]
        theirs = [their for _, their in pairs]
        with environ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}):
            self.context = tmp.start_processes(_by_name(pool_worker), args=(n, theirs), nprocs=n,
                                               join=False, start_method="fork")
        for their in theirs:
            their.close()
        for conn in self.conns:
            if not conn.poll(HANG_S) or conn.recv() != "ready":
                raise RuntimeError("bare pool: a process did not make its group")

    def step(self) -> List[tuple]:
        for conn in self.conns:
            conn.send(1)
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        deadline = time.monotonic() + 60
        while not self.context.join(timeout=1):
            if time.monotonic() > deadline:
                for p in self.context.processes:
                    p.kill()
                raise RuntimeError("bare pool: processes did not end")


# --- colab_xla's replicas, stamped -------------------------------------------------------

def instrument(stamps) -> None:
    """Wrap the replica's entry and the torch runtime's hooks so that replicas forked from
    this process stamp the timeline (the hooks' work is unchanged)."""
    from colab_xla import runtimes
    from colab_xla.replica import entry

    runtime = runtimes.get("torch")

    def rank() -> int:
        return int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0"))

    real = {name: getattr(runtime, name) for name in ("before_cell", "to_host", "after_process")}
    replica_process = entry.replica_process

    def stamped_replica_process(target, index, *args, **kwargs):
        _stamp(stamps, index, 0)
        return replica_process(target, index, *args, **kwargs)

    def before_cell():  # (once per process: it makes the group)
        _stamp(stamps, rank(), 1)
        real["before_cell"]()
        _stamp(stamps, rank(), 2)

    def to_host(value):
        _stamp(stamps, rank(), 3)
        return real["to_host"](value)

    def after_process():
        real["after_process"]()
        _stamp(stamps, rank(), 4)

    entry.replica_process = stamped_replica_process  # (launch looks it up at each run)
    runtime.before_cell, runtime.to_host = before_cell, to_host
    runtime.after_process = after_process


def _reset_stamps(n: int) -> None:
    for i in range(n * len(MILESTONES)):
        _STAMPS[i] = math.nan


def _timeline(n: int, t0: float) -> Optional[List[List[float]]]:
    """Each of ``n`` processes' stamps, ms from ``t0`` (None if one is missing)."""
    m = len(MILESTONES)
    ranks = [[(_STAMPS[r * m + k] - t0) * 1e3 for k in range(m)] for r in range(n)]
    if any(math.isnan(v) for row in ranks for v in row):
        return None
    return ranks


# --- the paths --------------------------------------------------------------------------

# Seconds, and ms from the call: one-off, each process's stamps (MILESTONES); warm, one row
# of phases (WARM_PHASES). None: not stamped. Then the CPU ms it took (_cpu_ms keys).
Sample = Tuple[float, Optional[List[List[float]]], Dict[str, float]]


def _cpu_ms(pids: Optional[List[int]]) -> Dict[str, float]:
    """CPU ms so far: this process's (every thread), its children's that ended (reaped),
    and, of ``pids``, every thread's time on a CPU and waiting for one (schedstat, ns)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {"notebook": time.process_time() * 1e3,
           "children": (children.ru_utime + children.ru_stime) * 1e3}
    if pids is not None:
        out["processes"], out["runqueue"] = schedstat_ms(pids)
    return out


def with_cpu(path: Callable, pids: Optional[List[int]] = None) -> Callable[[], Sample]:
    """``path`` (returning seconds and stamps), with the CPU it took, read around it (outside
    its own timing)."""
    def run() -> Sample:
        before = _cpu_ms(pids)
        elapsed, stamps = path()
        after = _cpu_ms(pids)
        return elapsed, stamps, {k: after[k] - before[k] for k in after}
    return run


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    if "xla_spawn" not in shell.magics_manager.magics["cell"]:
        with contextlib.redirect_stdout(io.StringIO()):
            shell.run_line_magic("load_ext", "colab_xla")
    return shell


def _values(printed: str, n: int) -> List[tuple]:
    """The cell's values in %%xla_spawn's text output ("Out: (4.0, t0, t1)")."""
    values = [ast.literal_eval(m) for m in re.findall(r"^Out: (\(.*\))$", printed, re.M)]
    if len(values) != n or any(v[0] != float(n) for v in values):
        raise RuntimeError(f"%%xla_spawn -n {n}: unexpected output:\n{printed[-3000:]}")
    return values


def _check_outcome(outcome, n: int) -> List[tuple]:
    if not outcome.ok:
        raise RuntimeError(f"run_cell N={n}: {[r.error for r in outcome.replicas.values()]}")
    values = outcome.results()
    if sorted(values) != list(range(n)) or any(v[0] != float(n) for v in values.values()):
        raise RuntimeError(f"run_cell N={n}: results {values}")
    return list(values.values())


def _by_name(function: Callable) -> Callable:
    """``function`` as this file's module, imported by name (a child started by spawn
    finds it so: IPython's shell makes its own module ``__main__``)."""
    import importlib

    return getattr(importlib.import_module(NAME), function.__name__)


def one_off_paths(n: int, shell, script: str,
                  gloo_lines: Optional[List[int]] = None) -> Dict[str, Callable[[], Sample]]:
    """Each runs the program once. ``gloo_lines`` gets, per %%xla_spawn run, how many of
    gloo's "[Gloo] Rank i is connected" lines it printed (the replicas' output)."""
    import torch.multiprocessing as tmp

    from colab_xla import runtimes
    from colab_xla.notebook.launch import Launch, environ, free_port
    from colab_xla.notebook.targets import run_cell

    launch = Launch(runtime=runtimes.get("torch"))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    job = _by_name(bare_job)

    def bare(method: str) -> Sample:
        _reset_stamps(n)
        with environ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}):
            t0 = time.perf_counter()
            tmp.start_processes(job, args=(n, _STAMPS), nprocs=n, start_method=method)
            elapsed = time.perf_counter() - t0
        return elapsed, _timeline(n, t0)

    def magic() -> Sample:
        _reset_stamps(n)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            t0 = time.perf_counter()
            shell.run_cell_magic("xla_spawn", f"--runtime torch -n {n} --no-widget", CELL)
            elapsed = time.perf_counter() - t0
        _values(out.getvalue(), n)
        if gloo_lines is not None:
            gloo_lines.append(out.getvalue().count("[Gloo] Rank"))
        return elapsed, _timeline(n, t0)

    def core() -> Sample:
        _reset_stamps(n)
        t0 = time.perf_counter()
        outcome = run_cell(CELL, replicas=n, launch=launch, announce=None)
        elapsed = time.perf_counter() - t0
        _check_outcome(outcome, n)
        return elapsed, _timeline(n, t0)

    def run_torchrun() -> Sample:
        command = [torchrun, "--nnodes", "1", "--nproc-per-node", str(n), "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), script]
        t0 = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S)
        elapsed = time.perf_counter() - t0
        rows = [m.split() for m in re.findall(r"STAMPS (\d+(?: [0-9.e+-]+){%d})\n"
                                              % len(MILESTONES), done.stdout)]
        if done.returncode != 0 or sorted(int(row[0]) for row in rows) != list(range(n)):
            raise RuntimeError(f"torchrun N={n}: exit {done.returncode}\n"
                               f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
        ranks = sorted((int(row[0]), [(float(v) - t0) * 1e3 for v in row[1:]]) for row in rows)
        return elapsed, [stamps for _, stamps in ranks]

    return {name: with_cpu(path) for name, path in (
        ("bare_fork", lambda: bare("fork")), ("bare_spawn", lambda: bare("spawn")),
        ("torchrun", run_torchrun), ("magic", magic), ("core", core))}


def warm_paths(n: int, shell, session, pool: Pool) -> Dict[str, Callable[[], Sample]]:
    """Each runs one warm cell (or bare step); returns its seconds, phases (ms,
    WARM_PHASES) and CPU (the session's processes, or the pool's)."""
    from colab_xla.notebook.targets import run_cell

    def phases(t0: float, t1: float, values: List[tuple]) -> List[float]:
        first, last = min(v[1] for v in values), max(v[1] for v in values)
        end = max(v[2] for v in values)
        return [(first - t0) * 1e3, (last - t0) * 1e3, (end - last) * 1e3, (t1 - end) * 1e3]

    def bare_step() -> Sample:
        t0 = time.perf_counter()
        values = pool.step()
        t1 = time.perf_counter()
        if any(v[0] != float(n) for v in values):
            raise RuntimeError(f"bare step N={n}: {values}")
        return t1 - t0, [phases(t0, t1, values)]

    def magic() -> Sample:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            t0 = time.perf_counter()
            shell.run_cell_magic("xla_spawn", "--no-widget", CELL)
            t1 = time.perf_counter()
        return t1 - t0, [phases(t0, t1, _values(out.getvalue(), n))]

    def core() -> Sample:
        t0 = time.perf_counter()
        outcome = run_cell(CELL, session=session, announce=None)
        t1 = time.perf_counter()
        return t1 - t0, [phases(t0, t1, _check_outcome(outcome, n))]

    replicas = [r.pid for r in session.replicas.values()]
    return {"bare_step": with_cpu(bare_step, pool.context.pids()),
            "magic": with_cpu(magic, replicas), "core": with_cpu(core, replicas)}


# --- measuring ----------------------------------------------------------------------------

def _summary(samples: Dict[str, List[Sample]], floor: str, names) -> dict:
    ms = {name: [s[0] * 1e3 for s in samples[name]] for name in names if samples[name]}
    # Per sample: the last process's time at each point (one-off; warm: the phases).
    rows = {name: [None if s[1] is None else [max(col) for col in zip(*s[1])]
                   for s in samples[name]] for name in ms}
    result = {"samples_ms": ms, "stats_ms": {name: stats(v) for name, v in ms.items()},
              "timeline_samples_ms": {name: [None if s[1] is None else
                                             [[round(v, 2) for v in r] for r in s[1]]
                                             for s in samples[name]] for name in ms},
              "timeline_median_ms": {name: _column_medians(rows[name]) for name in ms},
              "cpu_samples_ms": {name: [s[2] for s in samples[name]] for name in ms}}
    result["cpu_median_ms"] = {name: {k: stats([c[k] for c in cpus])["median"]
                                      for k in cpus[0]}
                               for name, cpus in result["cpu_samples_ms"].items()}
    base = result["stats_ms"][floor]["median"]
    result["ratio_of_medians"] = {name: s["median"] / base
                                  for name, s in result["stats_ms"].items()}
    # Paired with the floor's sample of the same iteration (the slow paths' iterations only).
    result["minus_floor_ms"] = {name: paired(ms[name], ms[floor]) for name in ms
                                if name != floor}
    return result


def _column_medians(rows: List[Optional[List[float]]]) -> Optional[List[float]]:
    rows = [r for r in rows if r is not None]
    return [stats(list(col))["median"] for col in zip(*rows)] if rows else None


def store_waits(result: dict, names) -> Dict[str, dict]:
    """Per path, the runs whose group took ``STORE_RETRY_MS`` or more after the last process
    was ready, the runs in which rank 0 was ready after another rank (a rank that asks rank
    0's TCPStore before it listens connects again after a back-off, 0.3-0.6 s here), and
    the runs that were both."""
    out = {}
    for name in names:
        runs = [r for r in result["timeline_samples_ms"].get(name, []) if r is not None]
        if not runs:
            continue
        waits = [max(p[2] for p in r) - max(p[1] for p in r) for r in runs]
        late = [len(r) > 1 and r[0][1] > min(p[1] for p in r[1:]) for r in runs]
        out[name] = {"runs": len(runs),
                     "slow_groups": sum(w >= STORE_RETRY_MS for w in waits),
                     "rank0_ready_last": sum(late),
                     "slow_groups_rank0_last": sum(w >= STORE_RETRY_MS and x
                                                   for w, x in zip(waits, late)),
                     "group_wait_ms": [round(w, 1) for w in waits]}
    return out


def measure_one_off(n: int, shell, script: str, repeats: int, warmups: int,
                    slow_repeats: int) -> dict:
    gloo_lines: List[int] = []
    paths = one_off_paths(n, shell, script, gloo_lines)
    for _ in range(warmups):
        for name in FAST:
            paths[name]()
    samples: Dict[str, List[Sample]] = {name: [] for name in FAST + SLOW}
    for i in range(repeats):
        names = FAST + (SLOW if i < slow_repeats else ())
        for name in rotated(names, i):
            samples[name].append(paths[name]())
    result = {"replicas": n, **_summary(samples, "bare_fork", FAST + SLOW)}
    result["store_waits"] = store_waits(result, FAST + SLOW)
    result["magic_gloo_lines"] = gloo_lines
    return result


def measure_warm(n: int, shell, repeats: int, warmups: int) -> dict:
    from colab_xla.notebook import targets

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        t0 = time.perf_counter()
        shell.run_line_magic("xla_session", f"start --runtime torch -n {n}")
        start_s = time.perf_counter() - t0
    session = targets.local_session()
    if session is None or not session.up:
        raise RuntimeError(f"%xla_session start -n {n}: {out.getvalue()}")
    pool = None
    try:
        t0 = time.perf_counter()
        pool = Pool(n)
        pool_start_s = time.perf_counter() - t0
        paths = warm_paths(n, shell, session, pool)
        first = {name: paths[name]()[0] * 1e3 for name in ("core", "bare_step")}  # groups
        for _ in range(warmups):
            for name in WARM:
                paths[name]()
        samples: Dict[str, List[Sample]] = {name: [] for name in WARM}
        for i in range(repeats):
            for name in rotated(WARM, i):
                samples[name].append(paths[name]())
    finally:
        if pool is not None:
            pool.close()
        with contextlib.redirect_stdout(io.StringIO()):
            shell.run_line_magic("xla_session", "stop")
    return {"replicas": n, "session_start_s": start_s, "pool_start_s": pool_start_s,
            "first_cell_ms": first, **_summary(samples, "bare_step", WARM)}


def measure_cold(counts: List[int], repeats: int) -> List[dict]:
    """One-off run_cell from this process before it imports torch (every replica imports
    it); then, with torch imported, the same interleaved is measured by the main table."""
    from colab_xla import runtimes
    from colab_xla.notebook.launch import Launch
    from colab_xla.notebook.targets import run_cell

    if "torch" in sys.modules:
        raise RuntimeError("torch is imported already: no cold measurement")
    launch = Launch(runtime=runtimes.get("torch"))
    results = []
    for n in counts:
        ms = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            outcome = run_cell(CELL, replicas=n, launch=launch, announce=None)
            ms.append((time.perf_counter() - t0) * 1e3)
            _check_outcome(outcome, n)
        results.append({"replicas": n, "samples_ms": ms, "stats_ms": stats(ms)})
    return results


# --- the section --------------------------------------------------------------------------

def _cell(s: Optional[Dict[str, float]], digits: int = 0) -> str:
    if s is None:
        return "–"
    if s["p10"] == s["p90"]:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['p10']:.{digits}f}–{s['p90']:.{digits}f})"


def _signed(s: Dict[str, float], digits: int = 0) -> str:
    return f"{s['median']:+.{digits}f} ({s['p10']:+.{digits}f}…{s['p90']:+.{digits}f})"


def _row(values: Optional[List[float]], digits: int = 0) -> str:
    if values is None:
        return " | ".join("–" for _ in MILESTONES)
    return " | ".join(f"{v:.{digits}f}" for v in values)


def render(one_off: List[dict], warm: List[dict], cold: List[dict], info: dict,
           seconds: float, args) -> str:
    lines = [
        "## torch runtime (`--runtime torch`) against bare torch.multiprocessing and torchrun",
        "",
        "The same gloo program (the default process group, one `dist.all_reduce` of a "
        "1-element tensor) in N processes on CPU, PJRT_DEVICE=CPU, interleaved in one "
        "process that imported torch (the order rotates each iteration). One-off launch: "
        "`%%xla_spawn --runtime torch -n N --no-widget` of the cell (a real IPython shell) "
        "and the IPython-free core `run_cell(..., launch=Launch(runtime='torch'))`, against "
        "a bare `torch.multiprocessing.start_processes(fn, nprocs=N, start_method='fork')` "
        "of a module-level function (`init_process_group('gloo')` by `env://` on a free "
        "port, the all_reduce, `destroy_process_group()`), and, in the first "
        f"{args.slow_repeats} iteration(s) only, the same by `start_method='spawn'` (as "
        "`torch.multiprocessing.spawn`) and `torchrun --nproc-per-node N` of a script "
        "doing the same. ms: median (p10–p90); ratio: median over the bare fork median; "
        "paired: median of each iteration's time minus that iteration's bare fork time.",
        "",
        "| N | bare fork ms | %%xla_spawn ms | ratio | paired ms | core run_cell ms | ratio "
        "| bare spawn ms | torchrun ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in one_off:
        s, q, d = r["stats_ms"], r["ratio_of_medians"], r["minus_floor_ms"]
        slow = [f"{_cell(s[name])} ({q[name]:.0f}×)" if name in s else "–" for name in SLOW]
        lines.append(f"| {r['replicas']} | {_cell(s['bare_fork'])} | {_cell(s['magic'])} "
                     f"| {q['magic']:.2f}× | {_signed(d['magic'])} | {_cell(s['core'])} "
                     f"| {q['core']:.2f}× | {slow[0]} | {slow[1]} |")
    lines += [
        "",
        "Where a one-off launch's time goes: ms from the call until the last process "
        "reached each point (median), then the call's return. Forked: the function "
        "entered (colab_xla: the replica's entry); ready: about to make the group, torch "
        "imported (colab_xla: the replica process set up and the cell's globals made, "
        "`before_cell` entered); group made: `init_process_group` returned (colab_xla: "
        "`before_cell` returned); all_reduce done (colab_xla: the cell's value "
        "handed to `to_host`); group destroyed (colab_xla: `after_process`). Slow groups: "
        f"runs whose group was made {STORE_RETRY_MS:.0f} ms or more after the last process "
        "was ready; rank 0 last: runs in which rank 0 was ready after another rank. CPU: "
        "ms of CPU time during the call (median), of this process (every thread) and of its "
        "children (the processes, reaped by the end of the call).",
        "",
        "| N | path | " + " | ".join(MILESTONE_LABELS) + " | returned | slow groups "
        "| rank 0 last | CPU ms: notebook / processes |",
        "|---:|---|" + "---:|" * (len(MILESTONES) + 4),
    ]
    for r in one_off:
        for name in ("bare_fork", "core", "magic") + SLOW:
            if name in r["stats_ms"]:
                w, cpu = r["store_waits"].get(name), r["cpu_median_ms"][name]
                waits = (f"{w['slow_groups']}/{w['runs']} | {w['rank0_ready_last']}/{w['runs']}"
                         if w else "– | –")
                lines.append(f"| {r['replicas']} | {LABELS[name]} "
                             f"| {_row(r['timeline_median_ms'][name])} "
                             f"| {r['stats_ms'][name]['median']:.0f} | {waits} "
                             f"| {cpu['notebook']:.0f} / {cpu['children']:.0f} |")
    if cold:
        same = {r["replicas"]: r["stats_ms"]["core"] for r in one_off}
        lines += ["", "From a notebook that never imported torch (before this process "
                  "imported it; every replica then imports torch itself), core `run_cell`, "
                  + ", ".join(f"N={c['replicas']}: {_cell(c['stats_ms'])} ms"
                              + (f" (with torch imported: {same[c['replicas']]['median']:.0f})"
                                 if c["replicas"] in same else "")
                              for c in cold) + "."]
    lines += [
        "",
        "Warm cell: the same cell on a session (`%xla_session start --runtime torch -n N`), "
        "through `%%xla_spawn --no-widget` and through core `run_cell(..., session=...)`, "
        "against the bare step: N processes started once by torch.multiprocessing (fork), "
        "their group made, each sent \"one step\" through a pipe and answering with its "
        "value after the all_reduce (the floor a warm cell could reach). ms: median "
        "(p10–p90); paired: median of each iteration's time minus its bare step's.",
        "",
        "| N | session start s | bare step ms | %%xla_spawn ms | paired ms | ratio "
        "| core run_cell ms | paired ms | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in warm:
        s, q, d = r["stats_ms"], r["ratio_of_medians"], r["minus_floor_ms"]
        lines.append(f"| {r['replicas']} | {r['session_start_s']:.2f} | {_cell(s['bare_step'], 1)} "
                     f"| {_cell(s['magic'], 1)} | {_signed(d['magic'], 1)} | {q['magic']:.1f}× "
                     f"| {_cell(s['core'], 1)} | {_signed(d['core'], 1)} | {q['core']:.1f}× |")
    lines += [
        "",
        "Phases of a warm cell (ms, medians): from the call until the first and the last "
        "process started the cell (or step), the cell (the last one's start to the last "
        "one's end) and collect (to the call's return); CPU time per cell (median) of this "
        "process (every thread) and of the N processes (every thread's time on a CPU, and "
        "waiting in a run queue for one: `/proc/PID/task/*/schedstat`), read around the call.",
        "",
        "| N | path | " + " | ".join(WARM_PHASES) + " | CPU ms: notebook / processes "
        "| run-queue wait ms |",
        "|---:|---|" + "---:|" * (len(WARM_PHASES) + 2),
    ]
    for r in warm:
        for name in WARM:
            t, cpu = r["timeline_median_ms"][name], r["cpu_median_ms"][name]
            lines.append(f"| {r['replicas']} | {LABELS[name]} | "
                         + " | ".join(f"{v:.1f}" for v in t)
                         + f" | {cpu['notebook']:.1f} / {cpu['processes']:.1f} "
                         f"| {cpu['runqueue']:.1f} |")
    lines += ["", _where(one_off, warm), "", _goals(one_off, warm), "",
              machine_line(info, NAME, seconds,
                           f"one-off: {args.repeats} repeats after {args.warmups} warm-up(s) "
                           f"per path, spawn and torchrun {min(args.slow_repeats, args.repeats)}; "
                           f"warm: {args.warm_repeats} repeats after {args.warmups} warm-up(s); "
                           f"PJRT_DEVICE=CPU", packages=f"IPython {info['ipython']}")]
    return "\n".join(lines)


def _where(one_off: List[dict], warm: List[dict]) -> str:
    """Where colab_xla's time goes beyond the bare paths, from the medians above."""
    top = one_off[-1]
    n, t, cpu = top["replicas"], top["timeline_median_ms"], top["cpu_median_ms"]
    text = ""
    if t["bare_fork"] and t["magic"]:
        points = t["magic"] + [top["stats_ms"]["magic"]["median"]]
        floor = t["bare_fork"] + [top["stats_ms"]["bare_fork"]["median"]]
        steps = [(p - f) - (points[k - 1] - floor[k - 1] if k else 0)
                 for k, (p, f) in enumerate(zip(points, floor))]
        names = ("the last process started", "it was about to make the group",
                 "the group was made", "the all_reduce was done", "the group was destroyed",
                 "the call returned")
        text += (f"Where the time goes (medians of each point, %%xla_spawn minus bare fork): "
                 f"at N={n}, {points[-1] - floor[-1]:+.0f} ms in all: "
                 + ", ".join(f"{d:+.0f} until {what}" for d, what in zip(steps, names))
                 + f"; CPU {cpu['magic']['notebook'] - cpu['bare_fork']['notebook']:+.0f} ms "
                 "in this process and "
                 f"{cpu['magic']['children'] - cpu['bare_fork']['children']:+.0f} ms in the "
                 "processes. ")
    gloo = [(c, r["replicas"]) for r in one_off for c in r["magic_gloo_lines"]]
    if gloo and any(c for c, _ in gloo):
        each = ("one per process" if all(c == n for c, n in gloo) else
                "per process: " + ", ".join(sorted({f"{c}/{n}" for c, n in gloo})))
        text += (f"Each one-off %%xla_spawn printed gloo's \"[Gloo] Rank i is connected to "
                 f"... peer ranks\" line, {each} (gloo writes it to stdout, so it reaches the "
                 "notebook as the replicas' output; the bare paths send it to /dev/null). ")
    def total(key: str) -> Dict[str, int]:
        return {name: sum(r["store_waits"][name][key] for r in one_off
                          if name in r["store_waits"]) for name in FAST + SLOW}

    slow, runs, raced = total("slow_groups"), total("runs"), total("slow_groups_rank0_last")
    if any(slow.values()):
        text += ("Slow groups (the p90s above): " + ", ".join(
            f"{LABELS[name]} {slow[name]}/{runs[name]}" for name in FAST + SLOW if runs[name])
                 + f" runs made their group {STORE_RETRY_MS:.0f} ms or more after the last "
                 f"process was ready. In {sum(raced.values())} of them rank 0 was ready after "
                 "another rank: a client that asks rank 0's TCPStore before it listens "
                 "connects again after a back-off (0.3–0.6 s here, measured apart). The "
                 "others, bare and colab_xla alike: on this machine (a gVisor sandbox) some of "
                 "c10d's TCPStore client connections complete ~1 or ~5 s late (c10d's log, "
                 "TORCH_CPP_LOG_LEVEL=INFO, shows the connect that late). ")
    if warm:
        w = warm[-1]
        n, t, cpu = w["replicas"], w["timeline_median_ms"], w["cpu_median_ms"]
        d = [a - b for a, b in zip(t["magic"], t["bare_step"])]
        text += (f"A warm cell at N={n} against the bare step (medians): "
                 f"{d[0]:+.1f} ms until the first process started the cell, {d[1] - d[0]:+.1f} "
                 f"more until the last did, {d[2]:+.1f} in the cell, {d[3]:+.1f} to collect; "
                 f"CPU per cell {cpu['magic']['notebook']:.1f} ms in this process (bare "
                 f"{cpu['bare_step']['notebook']:.1f}) and {cpu['magic']['processes']:.1f} ms "
                 f"in the {n} processes (bare {cpu['bare_step']['processes']:.1f}), which "
                 f"waited {cpu['magic']['runqueue']:.1f} ms in all for a CPU (bare "
                 f"{cpu['bare_step']['runqueue']:.1f}) on {os.cpu_count()} cores.")
    return text.strip()


def _goals(one_off: List[dict], warm: List[dict]) -> str:
    misses = [r for r in one_off if r["ratio_of_medians"]["magic"] > LAUNCH_GOAL_RATIO]
    launch = ("**met** for every N (" if not misses else "**not met** (") + ", ".join(
        f"N={r['replicas']}: {r['ratio_of_medians']['magic']:.2f}×" for r in one_off) + ")"
    text = (f"Goals: a one-off `%%xla_spawn --runtime torch` within {LAUNCH_GOAL_RATIO}× of "
            f"the bare fork launch (ratio of medians): {launch}.")
    if warm:
        top = warm[-1]
        over = top["minus_floor_ms"]["magic"]["median"]
        core = top["minus_floor_ms"]["core"]["median"]
        where = "" if top["replicas"] == 8 else " (the largest N run here; the goal's is 8)"
        text += (f" A warm cell within {WARM_GOAL_MS:.0f} ms of the bare step at "
                 f"N={top['replicas']}{where}: "
                 f"{'**met**' if over <= WARM_GOAL_MS else '**not met**'} "
                 f"(%%xla_spawn {over:+.1f} ms paired, core run_cell {core:+.1f} ms).")
    return text


def main(argv=None) -> int:
    global _STAMPS

    parser = bench_parser(__doc__)
    parser.add_argument("--replicas", default="1,2,4,8", help="process counts (1,2,4,8)")
    parser.add_argument("--repeats", type=int, default=12,
                        help="one-off launches per path and N (12)")
    parser.add_argument("--warmups", type=int, default=1,
                        help="untimed runs per path and N, one-off and warm (1)")
    parser.add_argument("--slow-repeats", type=int, default=2,
                        help="launches by spawn and by torchrun per N, in the first "
                             "iterations (2; 0: none)")
    parser.add_argument("--warm-repeats", type=int, default=30,
                        help="warm cells per path and N (30)")
    parser.add_argument("--cold-replicas", default="2",
                        help="process counts of the run from a torch-free process (2; '': none)")
    args = parser.parse_args(argv)
    counts = replica_counts(args.replicas)
    cold_counts = replica_counts(args.cold_replicas)
    if (args.repeats < 2 or args.warm_repeats < 2 or args.warmups < 0 or args.slow_repeats < 0
            or not counts or min(counts + cold_counts) < 1
            or max(counts + cold_counts) > MAX_PROCESSES):
        parser.error(f"need --repeats/--warm-repeats >= 2 and process counts 1..{MAX_PROCESSES}")

    os.environ["PJRT_DEVICE"] = "CPU"
    started = time.perf_counter()
    info = machine_info(args.repeats, args.warmups)
    _STAMPS = multiprocessing.get_context("fork").RawArray("d", MAX_PROCESSES * len(MILESTONES))
    instrument(_STAMPS)

    t0 = time.perf_counter()
    cold = measure_cold(cold_counts, 1)
    if cold:
        print(f"torch_runtime: cold {[round(c['stats_ms']['median']) for c in cold]} ms "
              f"[{time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    import torch  # noqa: F401 - the notebook's torch, before any timed fork

    shell = _shell()
    one_off, warm = [], []
    with tempfile.TemporaryDirectory(prefix="colab_xla-bench-torchrun-") as tmp:
        script = os.path.join(tmp, "all_reduce.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(TORCHRUN_SCRIPT)
        for n in counts:
            t0 = time.perf_counter()
            r = measure_one_off(n, shell, script, args.repeats, args.warmups, args.slow_repeats)
            one_off.append(r)
            s = r["stats_ms"]
            print(f"torch_runtime: N={n} one-off: bare fork {s['bare_fork']['median']:.0f}, "
                  f"%%xla_spawn {s['magic']['median']:.0f}, core {s['core']['median']:.0f}"
                  + "".join(f", {LABELS[k]} {s[k]['median']:.0f}" for k in SLOW if k in s)
                  + f" ms [{time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    for n in counts:
        t0 = time.perf_counter()
        r = measure_warm(n, shell, args.warm_repeats, args.warmups)
        warm.append(r)
        s = r["stats_ms"]
        print(f"torch_runtime: N={n} warm: bare step {s['bare_step']['median']:.1f}, "
              f"%%xla_spawn {s['magic']['median']:.1f}, core {s['core']['median']:.1f} ms; "
              f"session start {r['session_start_s']:.2f} s [{time.perf_counter() - t0:.0f} s]",
              file=sys.stderr)
    seconds = time.perf_counter() - started
    info["notebook_PJRT_DEVICE"] = "CPU"
    return publish(NAME, render(one_off, warm, cold, info, seconds, args),
                   {"machine": info, "seconds": seconds, "args": vars(args),
                    "goals": {"launch_ratio": LAUNCH_GOAL_RATIO, "warm_ms": WARM_GOAL_MS},
                    "milestones": list(MILESTONES), "cold": cold, "one_off": one_off,
                    "warm": warm}, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
