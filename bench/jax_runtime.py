"""The JAX runtime (``%%xla_spawn --runtime jax -n N``) against a bare ``multiprocessing``
launch of the same ``jax.distributed`` program, on CPU (one device per process).

In one process (which imports jax without starting a backend, as a notebook may, and
imports torch_xla through ``run_cell``: both paths fork from the same process), two
paths run the same program, interleaved (the order alternates every iteration):

* ``colab_xla``: ``run_cell(cell, replicas=N, launch=Launch(runtime="jax"))``, which
  initializes ``jax.distributed`` in every process before the cell and shuts it down
  after;
* ``bare``: what a user would write: N ``multiprocessing`` processes (fork), each calling
  ``jax.distributed.initialize`` with a coordinator port the parent picked free, running
  the program, sending its result through a pipe and calling
  ``jax.distributed.shutdown()``; the parent joins them all.

1. launch overhead: ``jax.process_index()`` as the program (``initialize``, the backend's
   start, the value back, the shutdown): median, p10-p90, ratio of medians and median of
   paired differences (N = 2 and 4 by default).
2. first-output latency: each process takes ``time.time()`` first thing in the program
   (right after ``initialize``) and prints it; ms until the notebook side sees the line (a
   ``RunObserver``'s ``output``; bare: the parent reading a pipe the children write), and
   from the call until the first line is seen.
3. interrupt-to-clean: a program that prints once, then sleeps forever (``sleep``), or in
   which process 0 waits in a collective for a process that never joins it
   (``collective``: gloo holds SIGINT until the collective returns). Once every process
   printed, a timer sends SIGINT to this process. colab_xla: until ``run_cell`` returns
   with ``outcome.interrupted``, then the replica pids still alive (psutil; zombies do not
   count). Bare: the KeyboardInterrupt reaches the parent's ``join``; it then does what a
   user would, ``terminate()`` every child and join them, for up to ``--term-cap`` s,
   and reports how long until all were gone, or how many were left (then kills them).

Writes the "jax_runtime" section of results.md and results/jax_runtime.json.

    python bench/jax_runtime.py [--processes 2,4] [--repeats 10] [--latency-repeats 4]
                                [--interrupts 2] [--term-cap 2] [--out DIR]
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (alive, bench_parser, machine_info, machine_line,  # noqa: E402
                      median_range, publish, replica_counts, rotated, stats)

NAME = "jax_runtime"
PATHS = ("colab_xla", "bare")
SIGNAL_DELAY_S = 0.2  # after the last process's first line
HANG_S = 60.0  # a run not done by then is cut, counted as hung, not measured
LATENCY_SLEEP_S = 0.3  # the program goes on this long after its line

TRIVIAL_CELL = "import jax\njax.process_index()"
LATENCY_CELL = ("import time\n_t = time.time()\nprint(f'stamp {index} {_t!r}', flush=True)\n"
                f"time.sleep({LATENCY_SLEEP_S!r})\n")
# Process 0 waits in a collective that process 1 never joins; process 1 sleeps.
STUCK_CELLS = {
    "sleep": "import time\nprint('ready', index, flush=True)\nwhile True:\n    time.sleep(0.05)\n",
    "collective": ("import time, numpy as np\nfrom jax.experimental import multihost_utils\n"
                   "print('ready', index, flush=True)\nif index == 0:\n"
                   "    multihost_utils.process_allgather(np.ones(1))\n"
                   "while True:\n    time.sleep(0.05)\n"),
}


# --- the bare launch ------------------------------------------------------------------------

def _bare_child(i: int, n: int, port: int, conn, out_fd: int, program: str) -> None:
    """One process of the bare launch (forked): the program between initialize and
    shutdown, as a user would write it."""
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n,
                               process_id=i, cluster_detection_method="deactivate",
                               initialization_timeout=120, heartbeat_timeout_seconds=10)
    if program == "trivial":
        conn.send(jax.process_index())
    elif program == "latency":
        t = time.time()
        os.write(out_fd, f"stamp {i} {t!r}\n".encode())
        time.sleep(LATENCY_SLEEP_S)
    else:  # sleep / collective: print once, then never end
        os.write(out_fd, f"ready {i}\n".encode())
        if program == "collective" and i == 0:
            import numpy as np
            from jax.experimental import multihost_utils

            multihost_utils.process_allgather(np.ones(1))
        while True:
            time.sleep(0.05)
    jax.distributed.shutdown()


class BareRun:
    """N forked processes running ``program``; lines they write arrive on a pipe."""

    def __init__(self, n: int, program: str):
        from colab_xla.notebook.launch import free_port

        ctx = multiprocessing.get_context("fork")
        self.n = n
        self.read_fd, write_fd = os.pipe()
        self.conns = []
        self.processes = []
        port = free_port()
        for i in range(n):
            parent_end, child_end = ctx.Pipe(duplex=False)
            self.conns.append(parent_end)
            self.processes.append(ctx.Process(target=_bare_child,
                                              args=(i, n, port, child_end, write_fd, program)))
        for p in self.processes:
            p.start()
        os.close(write_fd)
        self._buffer = b""

    def lines(self, count: int, on_line: Callable[[str, float], None], limit: float) -> None:
        """Read ``count`` lines from the children (calling ``on_line(line, arrived)``)."""
        import select

        deadline = time.monotonic() + limit
        seen = 0
        while seen < count:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError(f"bare: {seen} of {count} lines in {limit:g} s")
            chunk = os.read(self.read_fd, 65536)
            arrived = time.time()
            if not chunk:
                raise RuntimeError(f"bare: the children ended after {seen} of {count} lines")
            self._buffer += chunk
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                on_line(line.decode(), arrived)
                seen += 1

    def results(self) -> List[int]:
        return [conn.recv() for conn in self.conns]

    def join(self, limit: float = HANG_S) -> bool:
        deadline = time.monotonic() + limit
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        return all(p.exitcode == 0 for p in self.processes)  # (the caller closes)

    def close(self) -> None:
        for p in self.processes:
            if p.exitcode is None:
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        try:
            os.close(self.read_fd)
        except OSError:
            pass


# --- the three paths ------------------------------------------------------------------------

def _colab(n: int, source: str, observer=None, timeout: float = HANG_S):
    from colab_xla.notebook.launch import Launch
    from colab_xla.notebook.targets import run_cell

    return run_cell(source, replicas=n, launch=Launch(runtime="jax"), announce=None,
                    observer=observer, timeout=timeout)


def trivial_once(path: str, n: int) -> Optional[float]:
    """ms for the trivial program on ``path``; None if it hung (cut)."""
    expected = list(range(n))
    t0 = time.perf_counter()
    if path == "colab_xla":
        outcome = _colab(n, TRIVIAL_CELL)
        elapsed = time.perf_counter() - t0
        if outcome.ok and [outcome.results()[i] for i in range(n)] == expected:
            return elapsed * 1e3
        if elapsed >= HANG_S * 0.9:
            return None
        raise RuntimeError(f"colab_xla -n {n}: ok={outcome.ok} results={outcome.results()} "
                           f"errors={[r.error for r in outcome.replicas.values()]}")
    run = BareRun(n, "trivial")
    try:
        got = run.results()
        ok = run.join()
    finally:
        run.close()
    elapsed = time.perf_counter() - t0
    if not ok or got != expected:
        raise RuntimeError(f"{path} -n {n}: results={got} exit codes="
                           f"{[p.exitcode for p in run.processes]}")
    return elapsed * 1e3


def latency_once(path: str, n: int) -> dict:
    """Per line: print -> seen (ms); and the call -> first line seen (ms)."""
    arrivals: List[tuple] = []

    def on_line(line: str, arrived: float) -> None:
        parts = line.split()
        if len(parts) == 3 and parts[0] == "stamp":
            arrivals.append((int(parts[1]), float(parts[2]), arrived))

    called = time.time()
    if path == "colab_xla":
        from colab_xla.notebook.outcome import RunObserver

        class Recorder(RunObserver):
            def output(self, outcome, origin, lines):
                now = time.time()
                for line in lines:
                    on_line(line, now)

        outcome = _colab(n, LATENCY_CELL, Recorder())
        if not outcome.ok:
            raise RuntimeError(f"latency colab_xla: {outcome.replicas}")
    else:
        run = BareRun(n, "latency")
        try:
            run.lines(n, on_line, HANG_S)
            if not run.join():
                raise RuntimeError(f"latency {path}: exit codes "
                                   f"{[p.exitcode for p in run.processes]}")
        finally:
            run.close()
    if sorted(a[0] for a in arrivals) != list(range(n)):
        raise RuntimeError(f"latency {path}: expected one line per process, got {arrivals}")
    return {"print_to_seen_ms": [(seen - stamp) * 1e3 for _, stamp, seen in arrivals],
            "call_to_first_ms": (min(seen for _, _, seen in arrivals) - called) * 1e3}


class _Alarm:
    """SIGINT to this process ``SIGNAL_DELAY_S`` after ``arm()`` (from a timer thread)."""

    def __init__(self):
        self.signal_at: Optional[float] = None
        self.timer: Optional[threading.Timer] = None

    def arm(self) -> None:
        if self.timer is None:
            self.timer = threading.Timer(SIGNAL_DELAY_S, self._fire)
            self.timer.start()

    def _fire(self) -> None:
        self.signal_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    def wait(self) -> None:
        if self.timer is not None:
            self.timer.join()


def interrupt_once(path: str, n: int, variant: str, term_cap: float) -> dict:
    alarm = _Alarm()
    if path == "colab_xla":
        from colab_xla.notebook.outcome import RunObserver

        class Ready(RunObserver):
            def __init__(self):
                self.printed: set = set()

            def output(self, outcome, origin, lines):
                if isinstance(origin, int) and any(line.startswith("ready") for line in lines):
                    self.printed.add(origin)
                    if len(self.printed) >= n:
                        alarm.arm()

        outcome = _colab(n, STUCK_CELLS[variant], Ready())
        returned = time.monotonic()
        alarm.wait()
        if alarm.signal_at is None:
            return {"hung": True, "errors": {i: str(r.error) for i, r in
                                             outcome.replicas.items() if r.error}}
        pids = [r.pid for r in outcome.replicas.values() if r.pid]
        left_now = alive(pids)
        gone_at = time.monotonic() if not left_now else None
        while left_now and time.monotonic() - returned < term_cap:
            time.sleep(0.02)  # (measuring how long they stay, not synchronizing)
            if not alive(pids):
                gone_at = time.monotonic()
                break
        return {"hung": False, "return_ms": (returned - alarm.signal_at) * 1e3,
                "clean_ms": None if gone_at is None else (gone_at - alarm.signal_at) * 1e3,
                "interrupted": bool(outcome.interrupted), "left_at_return": len(left_now),
                "left_after_cap": len(alive(pids)),
                "states": sorted({r.state for r in outcome.replicas.values()})}
    run = BareRun(n, variant)
    pids = [p.pid for p in run.processes]
    try:
        run.lines(n, lambda line, arrived: None, HANG_S)
        alarm.arm()
        try:
            for p in run.processes:  # the user's cell: start, then join
                p.join()
            raise RuntimeError(f"{path}: the processes ended before the interrupt")
        except KeyboardInterrupt:
            caught = time.monotonic()
        for p in run.processes:  # what a user would do next
            p.terminate()
        deadline = time.monotonic() + term_cap
        for p in run.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        gone = all(p.exitcode is not None for p in run.processes)
        gone_at = time.monotonic()
        left = sum(p.exitcode is None for p in run.processes)
        codes = [p.exitcode for p in run.processes]
    finally:
        alarm.wait()
        run.close()  # kills what terminate() left
    return {"hung": False, "return_ms": (caught - alarm.signal_at) * 1e3,
            "clean_ms": (gone_at - alarm.signal_at) * 1e3 if gone else None,
            "left_after_cap": left, "exit_codes_after_terminate": codes,
            "left_after_kill": len(alive(pids))}


# --- report ---------------------------------------------------------------------------------

def _cell(s: Dict[str, float]) -> str:
    return f"{s['median']:.0f} ({s['p10']:.0f}–{s['p90']:.0f})"


def render(res: dict, info: dict, seconds: float, args) -> str:
    lines = [
        "## JAX runtime (`--runtime jax`) against a bare `multiprocessing` launch",
        "",
        "The same `jax.distributed` program, N processes of one CPU device each, through "
        "`run_cell(..., launch=Launch(runtime=\"jax\"))` (the core of `%%xla_spawn --runtime "
        "jax -n N`) and through a bare launch a user would write: N forked `multiprocessing` "
        "processes, each calling `jax.distributed.initialize` (coordinator on a free port), "
        "running the program, sending its value through a pipe and calling "
        "`jax.distributed.shutdown()`, joined by the parent. Interleaved in one process "
        "(the order alternates); the parent imports jax without starting a backend, and "
        "torch_xla (through `run_cell`). Each forked replica process first freezes what it "
        "inherited (`gc.freeze`): before it did, its first full garbage collection, set off "
        "by the backend's start, walked every object inherited from the notebook and "
        "copied the shared heap, 1.3–1.9 s per process (a trivial `-n 2` run took 2–3 s).",
        "",
        f"Launch overhead: `jax.process_index()` as the program (initialize, backend start, "
        f"value back, shutdown). ms, median (p10–p90) of {args.repeats}; ratio of medians; "
        "paired: median of (colab_xla − bare) in the same iteration.",
        "",
        "| N | colab_xla ms | bare ms | colab_xla / bare | paired diff ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, r in res["trivial"].items():
        s = r["stats_ms"]
        lines.append(f"| {n} | {_cell(s['colab_xla'])} | {_cell(s['bare'])} "
                     f"| {r['ratio']:.2f}× | {r['paired_ms']:+.0f} |")
    hung = {path: k for path, k in res["trivial_hung"].items() if k}
    if hung:
        lines += ["", f"Hung runs (cut after {HANG_S:g} s, left out above): "
                  + ", ".join(f"{path}: {k}" for path, k in hung.items()) + "."]
    lat = res["latency"]
    lines += [
        "",
        f"First-output latency (N = {lat['processes']}): each process takes `time.time()` "
        "first thing in the program and prints it; ms until the notebook side sees the line "
        "(colab_xla: a `RunObserver`'s `output`; bare: the parent reading a pipe the "
        "processes write), over every line of "
        f"{args.latency_repeats} runs; and from the call until the first line is seen "
        "(includes starting the processes and `initialize`). Median (min–max).",
        "",
        "| path | print → seen ms | call → first line ms |",
        "|---|---:|---:|",
    ]
    for path in PATHS:
        runs = lat["runs"][path]
        lines.append(f"| {path} | {median_range([x for r in runs for x in r['print_to_seen_ms']])} "
                     f"| {median_range([r['call_to_first_ms'] for r in runs])} |")
    cut = res["interrupts"]
    lines += [
        "",
        f"Interrupt-to-clean (N = {cut['processes']}, {args.interrupts} per path and "
        "program): *sleep*: the program prints, then sleeps forever; *collective*: process 0 "
        "waits in `process_allgather` for a process that never joins it (gloo holds SIGINT "
        f"there). {SIGNAL_DELAY_S:g} s after every process printed, a timer sends SIGINT to "
        "this process. colab_xla: ms until `run_cell` returns (with `outcome.interrupted`), "
        "and until every replica pid is gone. Bare: the KeyboardInterrupt reaches the "
        "parent's `join`; it `terminate()`s every child (SIGTERM) and joins them for up to "
        f"{args.term_cap:g} s: ms until all were gone, or how many were left (then killed). "
        "Median (min–max).",
        "",
        "| program | path | signal → return ms | signal → all gone ms | interrupted "
        "| left at return | left after cap |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for variant in STUCK_CELLS:
        for path, label in (("colab_xla", "colab_xla"), ("bare", "bare + terminate()")):
            runs = [r for r in cut["runs"][variant][path] if not r["hung"]]
            hung = len(cut["runs"][variant][path]) - len(runs)
            if not runs:
                lines.append(f"| {variant} | {label} | – (every run hung) | | | | |")
                continue
            gone = [r["clean_ms"] for r in runs]
            never = sum(g is None for g in gone)
            interrupted = (f"{sum(r['interrupted'] for r in runs)}/{len(runs)}"
                           if path == "colab_xla" else "(KeyboardInterrupt)")
            left_return = (str(sum(r["left_at_return"] for r in runs))
                           if path == "colab_xla" else "–")
            lines.append(
                f"| {variant} | {label} | {median_range([r['return_ms'] for r in runs])} "
                f"| {median_range(gone)}{f' ({never} not within the cap)' if never else ''} "
                f"| {interrupted} | {left_return} "
                f"| {sum(r['left_after_cap'] for r in runs)}"
                f"{f'; {hung} hung' if hung else ''} |")
    kept = sum(r["left_after_cap"] for v in cut["runs"].values() for r in v["bare"]
               if not r["hung"])
    if kept:
        lines += ["", f"Bare: {kept} children still alive {args.term_cap:g} s after "
                  "`terminate()`: JAX's preemption notifier catches SIGTERM once "
                  "`jax.distributed` is initialized, so `terminate()` does not end a JAX "
                  "process; the user needs `kill()` (SIGKILL), as colab_xla uses."]
    lines += [
        "",
        machine_line(info, NAME, seconds,
                     f"launch overhead: {args.repeats} repeats per path after 1 warm-up; "
                     f"latency: {args.latency_repeats}, interrupts: {args.interrupts} per "
                     "path and program; JAX_PLATFORMS=cpu",
                     packages=f"jax {info.get('jax', '?')}"),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    # The interrupts are SIGINTs to this process: a benchmark started in the background
    # inherits SIGINT ignored (a shell's `cmd &`), and the bare path's join would never end.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = bench_parser(__doc__)
    parser.add_argument("--processes", default="2,4",
                        help="JAX process counts for the launch overhead (2,4); latency and "
                             "interrupts use the smallest")
    parser.add_argument("--repeats", type=int, default=10, help="trivial runs per path (10)")
    parser.add_argument("--latency-repeats", type=int, default=4,
                        help="first-output runs per path (4)")
    parser.add_argument("--interrupts", type=int, default=2,
                        help="interrupts per path and program (2)")
    parser.add_argument("--term-cap", type=float, default=2.0,
                        help="s a bare launch waits for terminate()d children (2)")
    args, _ = parser.parse_known_args(argv)  # bench/run passes every benchmark's options
    counts = replica_counts(args.processes)
    if not counts or min(counts) < 2 or args.repeats < 2 or args.latency_repeats < 1 \
            or args.interrupts < 1 or args.term_cap <= 0:
        parser.error("need --processes >= 2 (a collective needs two), --repeats >= 2, "
                     "--latency-repeats/--interrupts >= 1, --term-cap > 0")
    try:
        import importlib.metadata
        jax_version = importlib.metadata.version("jax")
    except Exception:  # noqa: BLE001
        print("jax_runtime: jax is not installed: skipped", file=sys.stderr)
        return 0
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ["JAX_PLATFORMS"] = "cpu"  # (read when jax is imported)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # the bare path's
    import jax  # noqa: F401  (no backend: the notebook must not start one)

    started = time.perf_counter()
    info = machine_info(args.repeats, 1)
    info["jax"] = jax_version
    res: dict = {"trivial": {}}
    hung = {path: 0 for path in PATHS}
    for n in counts:
        t0 = time.perf_counter()
        for path in PATHS:  # warm-up (torch_xla's import in the notebook, the first fork)
            trivial_once(path, n)
        samples: Dict[str, List[float]] = {path: [] for path in PATHS}
        paired: List[float] = []
        for i in range(args.repeats):
            got = {path: trivial_once(path, n) for path in rotated(PATHS, i)}
            for path, ms in got.items():
                if ms is None:
                    hung[path] += 1
                else:
                    samples[path].append(ms)
            if None not in got.values():
                paired.append(got["colab_xla"] - got["bare"])
        st = {path: stats(samples[path]) for path in PATHS}
        res["trivial"][n] = {
            "samples_ms": samples, "stats_ms": st,
            "ratio": st["colab_xla"]["median"] / st["bare"]["median"],
            "paired_ms": statistics.median(paired)}
        print(f"jax_runtime: -n {n}: " + ", ".join(
            f"{p} {st[p]['median']:.0f} ms" for p in PATHS)
            + f" [{time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    res["trivial_hung"] = hung

    n = min(counts)
    t0 = time.perf_counter()
    lat = {path: [] for path in PATHS}
    for i in range(args.latency_repeats):
        for path in rotated(PATHS, i):
            lat[path].append(latency_once(path, n))
    res["latency"] = {"processes": n, "runs": lat}
    print(f"jax_runtime: latency [{time.perf_counter() - t0:.0f} s]", file=sys.stderr)

    t0 = time.perf_counter()
    cut: Dict[str, Dict[str, list]] = {v: {path: [] for path in PATHS} for v in STUCK_CELLS}
    for variant in STUCK_CELLS:
        for i in range(args.interrupts):
            for path in rotated(PATHS, i):
                cut[variant][path].append(interrupt_once(path, n, variant, args.term_cap))
    res["interrupts"] = {"processes": n, "term_cap_s": args.term_cap, "runs": cut}
    print(f"jax_runtime: interrupts [{time.perf_counter() - t0:.0f} s]", file=sys.stderr)

    seconds = time.perf_counter() - started
    return publish(NAME, render(res, info, seconds, args),
                   {"machine": info, "seconds": seconds, "args": vars(args), "results": res},
                   out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
