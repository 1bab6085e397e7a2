"""``%%xla_spawn`` side by side with what a notebook user would otherwise pick.

Four peers run the same module-level functions of ``peer_jobs.py``, in a real ipykernel
(jupyter_client; PJRT_DEVICE=CPU, CPU_NUM_DEVICES=N), each as its docs show:

* bare:        ``xmp.spawn(peer_jobs.FN, args=(...), start_method='fork')`` (the floor);
* accelerate:  ``notebook_launcher(peer_jobs.FN, args=(None, ...), num_processes=N,
               use_port=FREE)``: off Colab/Kaggle TPUs it runs torch.distributed's elastic
               agent in the kernel, which forks N worker processes (N=1: the function runs
               in the kernel itself); workers know their rank from ``$RANK``;
* px:          ipyparallel: ``ipp.Cluster(n=N).start_and_connect_sync()`` in the kernel
               (timed on its own, before anything else), ``index`` pushed to each engine,
               then ``%%px`` cells ``peer_jobs.FN(index, ...)`` (values: ``rc[:].apply_sync``,
               since ``%%px`` returns none). Engines are N long-lived processes without
               torch_xla replicas: the same Python work, without an XLA runtime;
* xla:         ``%%xla_spawn -n N --no-widget`` cells ``peer_jobs.FN(index, ...)`` (the text
               view: its output is IOPub ``stream`` messages; launch is also timed with the
               default widget view).

Measures (median and p10/p90 of repeated runs unless said):

1. launch: wall time of a trivial cell, from ``execute_request`` to the kernel's ``idle``,
   the peers interleaved (order rotating each repeat), ratio and paired difference to bare;
2. first-output latency: each replica takes ``time.time()`` and prints it at once, then
   sleeps; the time this process receives the IOPub message carrying that line, minus it;
3. output throughput: every replica prints ``r{index} line {i}``; lines/s (execute to idle)
   and lost / mixed / out-of-order lines, counted from what reached the notebook (IOPub
   ``stream`` messages; ``%%px``: the last update of each engine's output display) or, for
   ``%%xla_spawn``, whose live view shows the first lines, from its full logs. Peers that
   run at a few hundred lines/s get ``--slow-lines`` per replica (the table says so);
4. result return: each replica makes a ``--return-mib`` MiB float32 tensor; time until
   all are values in the kernel, against the same job returning only its size (paired), and
   against ``_results.Memcpy`` in the kernel (a warm copy of as many bytes: the reference);
5. interrupt-to-clean: a job that runs until stopped; once every replica has said it
   started, SIGINT to the kernel (``KernelManager.interrupt_kernel``, its process group);
   time until no process the run started is alive (``%%px``: until no engine is busy).
   If the kernel is still busy ``--interrupt-cap`` s after an interrupt, it gets another
   (as a person would press again), up to ``--max-interrupts``; if still busy, the
   benchmark kills the run's processes. Processes of the run still alive after all cycles
   are counted, then killed (by pid, never by name).

Writes the "peers" section of results.md and results/peers.json.

    python bench/peers.py [--replicas 1,4,8] [--repeats 15] [--out DIR] ...
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import queue
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import psutil

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (MEMCPY_PROSE, bench_parser, fastest, machine_info,  # noqa: E402
                      machine_line, paired, publish, replica_counts, rotated, stats,
                      ways_prose)
from output_throughput import (Kernel, RssSampler, run_magic, run_streamed,  # noqa: E402
                               split_lines, summarize, tally)


NAME = "peers"
PEERS = ("bare", "accelerate", "px", "xla")
# "forks": N processes forked from the kernel, each calling fn: the floor of one process
# per replica (the CPU simulation's default, a TPU v4 or later host's model).
LAUNCH_PEERS = PEERS + ("xla_widget", "forks")
# Timed after the others, on a session started in the kernel (``%xla_session start -n N``),
# interleaved with ``%%px`` again (px_beside_session) so the two are side by side.
SESSION_PEERS = ("xla_session", "xla_session_widget")
LABEL = {"bare": "bare `xmp.spawn` (floor)", "accelerate": "`accelerate.notebook_launcher`",
         "px": "ipyparallel `%%px`", "xla": "`%%xla_spawn`",
         "xla_widget": "`%%xla_spawn` (widget view)",
         "forks": "N forked processes (`peer_jobs.fork_each(N)`, floor of a process per replica)",
         "xla_session": "warm `%xla_session` cell",
         "xla_session_widget": "warm `%xla_session` cell (widget view)",
         "px_beside_session": "ipyparallel `%%px` (interleaved with the session cells)"}
# Goals of issue 18, in ms above the bare median (launch of the trivial cell).
GOAL_ABOVE_FLOOR_MS = {"xla_widget": 30.0, "xla": 10.0}
ACCELERATE_BANNER = re.compile(r"^Launching training on ")
_STAMP = re.compile(r"stamp (\d+) (\d+\.\d+)")
_PX_PREFIX = re.compile(r"^\[stdout:(\d+)\] ")


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Session:
    """One kernel with N replicas' environment, and an ipyparallel cluster of N engines."""

    def __init__(self, n: int, engine_torch: bool = False):
        self.n = n
        t0 = time.perf_counter()
        self.k = Kernel(n)
        self.kernel_start_s = time.perf_counter() - t0
        self._before = self.descendants()  # nothing of ours yet
        try:
            self._start(engine_torch)
        except BaseException:
            self.close()
            raise

    def _start(self, engine_torch: bool) -> None:
        n = self.n
        setup = self.run(f"""\
import sys, time
sys.path.insert(0, {BENCH_DIR!r})
import peer_jobs
import torch_xla.distributed.xla_multiprocessing as xmp
from accelerate import notebook_launcher
from colab_xla.notebook.launch import free_port
import ipyparallel as ipp
get_ipython().run_line_magic("load_ext", "colab_xla")
""", deadline=180)
        self.setup_s = setup["idle_s"]
        # As the ipyparallel docs start a cluster from a notebook; timed in the kernel.
        started = self.value(f"""\
_t0 = time.perf_counter()
cluster = ipp.Cluster(n={n})
rc = cluster.start_and_connect_sync()
dv = rc[:]
_cluster_start_s = time.perf_counter() - _t0
assert sorted(rc.ids) == list(range({n})), rc.ids
(_cluster_start_s, cluster.controller.connection_files["client"])""", deadline=300)
        self.cluster_start_s, connection_file = eval(started)  # a (float, str) repr
        t0 = time.perf_counter()
        imports = "import peer_jobs" + ("; import torch" if engine_torch else "")
        self.run(f"""\
dv.execute("import sys; sys.path.insert(0, {BENCH_DIR!r}); {imports}", block=True)
for _i in rc.ids:
    rc[_i].push(dict(index=_i), block=True)""", deadline=300)
        self.engine_setup_s = time.perf_counter() - t0
        import ipyparallel

        self.client = ipyparallel.Client(connection_file)  # to see the engines' queues

    # -- kernel ---------------------------------------------------------------------------

    def run(self, code: str, deadline: float = 120, ok: bool = True, **kw) -> dict:
        r = self.k.execute(code, deadline=deadline, grace=kw.pop("grace", 0.0), **kw)
        if r["timed_out"]:
            self.k.recover()
        if ok and (r["status"] != "ok" or r["timed_out"]):
            raise RuntimeError(f"N={self.n}: {code[:200]!r} -> {r['status']} {r['error']}"
                               f"{' (timed out)' if r['timed_out'] else ''}:\n"
                               f"{r['stdout'][-1500:]}\n{r['stderr'][-1500:]}")
        return r

    def value(self, code: str, deadline: float = 120) -> str:
        r = self.run(code, deadline=deadline)
        if r["result"] is None:
            raise RuntimeError(f"N={self.n}: no value from {code[:200]!r}")
        return r["result"]

    def cell(self, peer: str, fn: str, args: str = "") -> str:
        """The cell a user types to run ``peer_jobs.fn`` on every replica with ``peer``."""
        n, rest = self.n, f", {args}" if args else ""
        if peer == "bare":
            return (f"xmp.spawn(peer_jobs.{fn}, args=({args},), start_method='fork')" if args
                    else f"xmp.spawn(peer_jobs.{fn}, start_method='fork')")
        if peer == "forks":
            return f"peer_jobs.fork_each({n}, peer_jobs.{fn})"
        if peer == "accelerate":
            return (f"notebook_launcher(peer_jobs.{fn}, args=(None,{' ' + args if args else ''}), "
                    f"num_processes={n}, "
                    # a port of its own each call: a fixed one was once still held (in use
                    # after the previous call's close) and the launch failed to listen
                    "use_port=str(free_port()))")
        if peer in ("px", "px_beside_session"):
            return f"%%px\npeer_jobs.{fn}(index{rest})"
        view = "" if peer.endswith("_widget") else " --no-widget"
        if peer.startswith("xla_session"):  # the session's replicas: no -n (README)
            return f"%%xla_spawn{view}\npeer_jobs.{fn}(index{rest})"
        return f"%%xla_spawn -n {n}{view}\npeer_jobs.{fn}(index{rest})"

    def descendants(self) -> Dict[int, psutil.Process]:
        found = {}
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process(self.k.pid).children(recursive=True):
                found[proc.pid] = proc
        return found

    def engines_busy(self) -> int:
        status = self.client.queue_status()
        return sum(1 for key, v in status.items() if isinstance(key, int) and v["queue"])

    def close(self) -> None:
        leftovers = {pid: p for pid, p in self.descendants().items() if pid not in self._before}
        if getattr(self, "client", None) is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        with contextlib.suppress(Exception):
            self.run("cluster.stop_cluster_sync()", deadline=60, ok=False)
        self.k.shutdown()
        kill(list(leftovers.values()))  # whatever outlived the kernel: ours, by pid


def kill(procs: List[psutil.Process]) -> int:
    """SIGKILL these processes (psutil checks pid and start time); how many were alive."""
    victims = [p for p in procs if alive(p)]
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(victims, timeout=5)
    return len(victims)


# --- 1. launch -------------------------------------------------------------------------------


def measure_launch(s: Session, repeats: int, warmups: int) -> dict:
    cells = {p: s.cell(p, "trivial") for p in LAUNCH_PEERS}
    for _ in range(warmups):
        for p in LAUNCH_PEERS:
            s.run(cells[p])
    samples: Dict[str, List[float]] = {p: [] for p in LAUNCH_PEERS}
    for i in range(repeats):
        for p in rotated(LAUNCH_PEERS, i):
            samples[p].append(s.run(cells[p])["idle_s"] * 1e3)
    # A warm session's cell, side by side with %%px: a session started before timing (every
    # %%xla_spawn cell runs on it while it is up, so after the one-off peers), stopped after.
    warm = ("px_beside_session",) + SESSION_PEERS
    cells.update({p: s.cell(p, "trivial") for p in warm})
    s.run(f"get_ipython().run_line_magic('xla_session', 'start -n {s.n}')", deadline=300)
    try:
        for _ in range(warmups + 1):  # the first cell on a session imports and compiles
            for p in warm:
                s.run(cells[p])
        for p in warm:
            samples[p] = []
        for i in range(repeats):
            for p in rotated(warm, i):
                samples[p].append(s.run(cells[p])["idle_s"] * 1e3)
    finally:
        s.run("get_ipython().run_line_magic('xla_session', 'stop')", deadline=120, ok=False)
    every = LAUNCH_PEERS + warm
    result = {"replicas": s.n, "cells": cells, "samples_ms": samples,
              "stats_ms": {p: stats(samples[p]) for p in every}}
    bare = result["stats_ms"]["bare"]["median"]
    result["minus_bare_ms"] = {p: paired(samples[p], samples["bare"]) for p in LAUNCH_PEERS}
    result["minus_forks_ms"] = {p: paired(samples[p], samples["forks"])
                                for p in ("xla", "xla_widget")}
    result["minus_px_ms"] = {p: paired(samples[p], samples["px_beside_session"])
                             for p in SESSION_PEERS}
    result["ratio_of_medians"] = {p: result["stats_ms"][p]["median"] / bare for p in every}
    return result


# --- 2. first-output latency -------------------------------------------------------------------


def message_text(msg: dict) -> str:
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        return content["text"]
    if kind in ("display_data", "update_display_data", "execute_result"):
        return content.get("data", {}).get("text/plain", "")
    return ""


def measure_latency(s: Session, repeats: int, sleep: float) -> dict:
    samples: Dict[str, List[dict]] = {p: [] for p in PEERS}
    missing: Dict[str, int] = {p: 0 for p in PEERS}
    cells = {p: s.cell(p, "stamp", repr(sleep)) for p in PEERS}
    for p in PEERS:  # warm-up
        s.run(cells[p])
    for i in range(repeats):
        for p in PEERS[i % 4:] + PEERS[:i % 4]:
            first: Dict[int, tuple] = {}

            def seen(msg, arrived, first=first):
                for m in _STAMP.finditer(message_text(msg)):
                    first.setdefault(int(m.group(1)), (float(m.group(2)), arrived))

            s.run(cells[p], on_message=seen)
            missing[p] += s.n - len(first)
            for ordinal, (stamp, arrived) in sorted(first.items()):
                samples[p].append({"run": i, "replica": ordinal,
                                   "latency_ms": (arrived - stamp) * 1e3})
    return {"replicas": s.n, "sleep": sleep, "cells": cells, "samples": samples,
            "missing": missing,
            "stats_ms": {p: stats([x["latency_ms"] for x in samples[p]]) for p in PEERS}}


# --- 3. output throughput ----------------------------------------------------------------------


def run_px_printer(s: Session, n: int, deadline: float) -> dict:
    """``%%px`` of the print loop; lines from the last update of each engine's stdout
    display (``[stdout:K] ...``). ipyparallel's own progress bar, a ``stream``, is not
    engine output and is not counted."""
    final: Dict[str, str] = {}

    def keep(msg, arrived):
        if msg["msg_type"] in ("display_data", "update_display_data"):
            content = msg["content"]
            text = content.get("data", {}).get("text/plain", "")
            key = content.get("transient", {}).get("display_id") or f"anon-{len(final)}"
            if _PX_PREFIX.match(text):
                final[key] = text

    with RssSampler(s.k.pid) as rss:
        r = s.run(s.cell("px", "printer", str(n)), deadline=deadline, ok=False,
                  on_message=keep, grace=1.0)
    c = tally([], s.n, n)
    for text in final.values():
        m = _PX_PREFIX.match(text)
        tally(split_lines(text[m.end():]), s.n, n, owner=int(m.group(1)), counts=c)
    counts = summarize(c, s.n, n)
    wall = r["idle_s"] if r["idle_s"] is not None else deadline
    return {"path": "px", "replicas": s.n, "lines": n, "wall_s": wall,
            "lines_per_s": s.n * n / wall, **counts, **rss.result(),
            "displays": len(final), "kernel_status": r["status"],
            "kernel_timed_out": r["timed_out"]}


def measure_throughput(s: Session, lines: int, slow_lines: int, repeats: int,
                       deadline: float) -> dict:
    n = s.n
    banner = f"Launching training on {n} CUDAs." if n > 1 else "Launching training on CPU."

    def once(peer: str, size: int, dl: float = deadline) -> dict:
        if peer == "xla":
            return {**run_magic(s.k, n, size, dl, body=f"peer_jobs.printer(index, {size})"),
                    "path": "xla"}
        if peer == "px":
            return run_px_printer(s, size, dl)
        return run_streamed(s.k, s.cell(peer, "printer", str(size)), peer, n, size, dl,
                            banner=banner if peer == "accelerate" else None)

    size = {"xla": lines, "px": lines, "bare": slow_lines, "accelerate": slow_lines}
    for p in PEERS:  # warm-ups: fork paths, the engines, colab_xla's first run
        once(p, 10, 60)
    runs: Dict[str, List[dict]] = {p: [] for p in PEERS}
    for i in range(repeats):
        for p in PEERS[i % 4:] + PEERS[:i % 4]:
            runs[p].append(once(p, size[p]))
    out = {}
    for p in PEERS:
        rs = runs[p]
        out[p] = {"replicas": n, "lines": size[p], "runs": rs,
                  "lines_per_s": stats([r["lines_per_s"] for r in rs]),
                  "wall_s": stats([r["wall_s"] for r in rs]),
                  "rss_peak_growth_mb": max(r["rss_peak_growth_mb"] for r in rs),
                  **{k: sum(r[k] for r in rs)
                     for k in ("expected", "lost", "out_of_order", "mixed", "duplicates")},
                  "mixed_examples": [e for r in rs for e in r.get("mixed_examples", [])][:5]}
    return out


# --- 4. result return --------------------------------------------------------------------------


def measure_return(s: Session, mib: int, repeats: int) -> dict:
    n, nbytes = s.n, s.n * (mib << 20)
    # The reference result_return.py uses too, in the kernel (the notebook's process).
    ways = eval(s.value(f"__import__('_results').memcpy_ways({mib << 20}, {n}, {repeats})",
                        deadline=300))
    memcpy = [fastest(sample) for sample in ways]
    cells = {
        "xla": (f"%%xla_spawn -n {n} --no-widget -o _vals\npeer_jobs.tensor(index, {mib})",
                f"%%xla_spawn -n {n} --no-widget\npeer_jobs.tensor_size(index, {mib})"),
        # on a session started below (no -n: the session's replicas run the cell)
        "xla_session": (f"%%xla_spawn --no-widget -o _vals\npeer_jobs.tensor(index, {mib})",
                        f"%%xla_spawn --no-widget\npeer_jobs.tensor_size(index, {mib})"),
        "px": (f"_vals = dict(enumerate(dv.apply_sync(peer_jobs.tensor, "
               f"ipp.Reference('index'), {mib})))",
               f"dv.apply_sync(peer_jobs.tensor_size, ipp.Reference('index'), {mib})"),
    }
    check = ("sorted((k, float(v[0]), float(v[-1]), v.numel(), str(v.dtype)) "
             "for k, v in _vals.items())")
    expect = repr(sorted((i, float(i), float(i), mib << 18, "torch.float32") for i in range(n)))
    samples: Dict[str, Dict[str, List[float]]] = {p: {"return": [], "size_only": []}
                                                  for p in cells}

    def returned(p: str) -> float:
        r = s.run(cells[p][0], deadline=300)
        got = s.value(check)
        # Freed: the next results write into its pages (as in a loop). ipyparallel's client
        # keeps every result it received: 1 GiB a run in the kernel, which every later fork
        # of it (every other peer's run) would copy and tear down.
        s.run("del _vals" + ("; rc.purge_local_results('all')" if p == "px" else ""))
        if got.replace("\n", "").replace(" ", "") != expect.replace(" ", ""):
            raise RuntimeError(f"{p} returned {got[:300]}, expected {expect[:300]}")
        return r["idle_s"]

    def interleaved(peers) -> None:
        for p in peers:  # warm-up: the first cells, and the first large result
            s.run(cells[p][1], deadline=300)
            returned(p)
        order = [(p, what) for p in peers for what in ("return", "size_only")]
        for i in range(repeats):
            for p, what in order[i % len(order):] + order[:i % len(order)]:
                samples[p][what].append(
                    returned(p) if what == "return"
                    else s.run(cells[p][1], deadline=300)["idle_s"])

    interleaved(("xla", "px"))
    # Then the session's cells, alone in a second loop: while a session is up, a cell's -n
    # runs it on the session's replicas.
    s.run(f"get_ipython().run_line_magic('xla_session', 'start -n {n}')", deadline=300)
    try:
        interleaved(("xla_session",))
    finally:
        s.run("get_ipython().run_line_magic('xla_session', 'stop')", deadline=120, ok=False)
    out = {"replicas": n, "mib": mib, "bytes": nbytes, "cells": cells, "samples_s": samples,
           "memcpy_s": memcpy, "memcpy_ways_s": ways,
           "memcpy_gb_s": nbytes / statistics.median(memcpy) / 1e9}
    for p in cells:
        ret, size = samples[p]["return"], samples[p]["size_only"]
        differences = paired(ret, size)
        out[p] = {"return_s": stats(ret), "size_only_s": stats(size),
                  "return_minus_size_s": differences,
                  "end_to_end_gb_s": nbytes / statistics.median(ret) / 1e9,
                  "return_gb_s": (nbytes / differences["median"] / 1e9
                                  if differences["median"] > 0 else None)}
    return out


# --- 5. interrupt ----------------------------------------------------------------------------


def interrupt_cycle(s: Session, peer: str, cap: float, max_interrupts: int,
                    start_deadline: float = 20.0) -> dict:
    kc, km = s.k.kc, s.k.km
    marker_dir = tempfile.mkdtemp(prefix="peers-")
    before = set(s.descendants())
    msg_id = kc.execute(s.cell(peer, "forever", repr(marker_dir)))
    t_start = time.monotonic()
    while len(os.listdir(marker_dir)) < s.n and time.monotonic() - t_start < start_deadline:
        time.sleep(0.005)  # waiting for the replicas' marker files, not for time
    started = len(os.listdir(marker_dir))
    run = [p for pid, p in s.descendants().items() if pid not in before]
    c = {"started": started, "processes": len(run), "interrupts": 0, "clean_s": None,
         "kernel_back_s": None, "status": None, "killed_by_benchmark": 0,
         "kernel_restarted": False, "busy_engines_at_end": 0, "ename": None}
    t0 = time.time()

    def clean() -> bool:
        if peer == "px":
            return c["kernel_back_s"] is not None and s.engines_busy() == 0
        return not any(alive(p) for p in run)

    while c["interrupts"] < max_interrupts and c["kernel_back_s"] is None:
        km.interrupt_kernel()
        c["interrupts"] += 1
        last = time.time()
        while time.time() - last < cap:
            if c["kernel_back_s"] is None:
                with contextlib.suppress(queue.Empty):
                    reply = kc.get_shell_msg(timeout=0)
                    if reply["parent_header"].get("msg_id") == msg_id:
                        c["kernel_back_s"] = time.time() - t0
                        c["status"] = reply["content"]["status"]
                        c["ename"] = reply["content"].get("ename")
            if c["clean_s"] is None and clean():
                c["clean_s"] = time.time() - t0
            if c["clean_s"] is not None and c["kernel_back_s"] is not None:
                break
            time.sleep(0.002)
    if c["kernel_back_s"] is None:  # still busy after every interrupt: free the kernel
        c["killed_by_benchmark"] = kill(run)
        try:
            while True:
                reply = kc.get_shell_msg(timeout=10)
                if reply["parent_header"].get("msg_id") == msg_id:
                    c["status"] = reply["content"]["status"]
                    break
        except queue.Empty:
            km.restart_kernel(now=True)
            kc.wait_for_ready(timeout=120)
            c["kernel_restarted"] = True
    if peer == "px":
        c["busy_engines_at_end"] = s.engines_busy()
    c["alive_at_end"] = sum(alive(p) for p in run)
    c["run"] = run
    shutil.rmtree(marker_dir, ignore_errors=True)
    return c


def measure_interrupt(s: Session, cycles: int, cap: float, max_interrupts: int) -> dict:
    out = {"replicas": s.n, "cycles": cycles, "cap_s": cap, "max_interrupts": max_interrupts,
           "cells": {p: s.cell(p, "forever", "'DIR'") for p in PEERS}}
    for peer in PEERS:
        results = [interrupt_cycle(s, peer, cap, max_interrupts) for _ in range(cycles)]
        procs = [p for r in results for p in r.pop("run")]
        left = sum(alive(p) for p in procs)
        busy = s.engines_busy() if peer == "px" else 0
        out[peer] = {
            "cycles": results, "left_after": left,
            "busy_engines_after": busy,
            "clean": sum(r["clean_s"] is not None for r in results),
            "clean_s": stats([r["clean_s"] for r in results if r["clean_s"] is not None]),
            "kernel_back_s": stats([r["kernel_back_s"] for r in results
                                    if r["kernel_back_s"] is not None]),
            "interrupts": sum(r["interrupts"] for r in results),
            "killed_by_benchmark": sum(r["killed_by_benchmark"] for r in results),
            "kernel_restarts": sum(r["kernel_restarted"] for r in results),
        }
        kill(procs)  # the leftovers are counted: now they go (by pid)
        if busy:  # engines still running the job: stop it before the next peer
            s.client.send_signal("SIGINT", block=True)
    return out


# --- report ------------------------------------------------------------------------------------


def _ms(st: Optional[dict], digits: int = 0) -> str:
    if st is None:
        return "—"
    return f"{st['median']:.{digits}f} ({st['p10']:.{digits}f}–{st['p90']:.{digits}f})"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


def throughput_lines(t: dict) -> List[str]:
    """Section 3's markdown lines, from ``res["throughput"]``."""
    full, runs = t["xla"]["lines"], len(t["xla"]["runs"])
    L = ["### 3. Output throughput", "",
          f"Every replica prints `r{{index}} line {{i}}`; {t['xla']['replicas']} replicas, "
          f"{runs} runs per peer, interleaved. Lines counted from what reached the notebook: "
          "IOPub `stream` messages; for `%%px`, the last update of each engine's output "
          "display (it re-sends an engine's whole output on every update); for "
          "`%%xla_spawn`, its full logs (its live view shows the first 200 lines per "
          "replica). *mixed*: not exactly `r<k> line <i>` (or under another replica); *out of "
          "order*: after a later line of its replica; *lost*: never seen intact; each summed "
          f"over the {runs} runs. lines/s: `execute_request` to `idle`, median (min–max). "
          "RSS: the kernel's largest peak growth.", "",
          "| peer | replicas × lines | lines/s | lost | out of order | mixed | RSS MB |",
          "|---|---|---:|---:|---:|---:|---:|"]
    for p in PEERS:
        r = t[p]
        mark = " ¹" if r["lines"] != full else ""
        lps = r["lines_per_s"]
        L.append(f"| {LABEL[p]} | {r['replicas']} × {r['lines']:,}{mark} | {lps['median']:,.0f} "
                 f"({lps['min']:,.0f}–{lps['max']:,.0f}) | {r['lost']:,} of {r['expected']:,} "
                 f"| {r['out_of_order']:,} | {r['mixed']:,} | +{r['rss_peak_growth_mb']:.1f} |")
    slow = [p for p in PEERS if t[p]["lines"] != full]
    if slow:
        ests = "; ".join(
            f"{LABEL[p]} ≈{_duration(full * t[p]['replicas'] / t[p]['lines_per_s']['median'])}"
            for p in slow)
        example = next((t[p]["mixed_examples"][0] for p in slow if t[p]["mixed_examples"]), "")
        L += ["", f"¹ {t[slow[0]]['lines']:,} lines per replica, not {full:,}: every `print` "
                  "of a forked child goes out on its own (text, then newline) from the child's "
                  "copy of ipykernel's OutStream, so the full size would take "
                  f"{ests}. Lines are lost by being glued to other replicas' text"
                  + (f" (e.g. `{example[:60]}`)." if example else ".")]
    L.append("")
    ratio = t["xla"]["lines_per_s"]["median"] / t["px"]["lines_per_s"]["median"]
    L += [f"`%%xla_spawn` / ipyparallel `%%px` lines/s, same run: **{ratio:.2f}×**.", ""]
    return L


# Where a warm session cell's time went: traced hand-overs of the core (N=1), and the widget A/B.
SESSION_CELL_PROFILE = (
    "Where a warm session cell's time goes (measured once, outside this benchmark: a "
    "timestamp at each hand-over of the core's `run_cell`, 300 cells at N=1): ~2.4 ms a "
    "cell in the core, ~4.0 before a replica's end woke the notebook's reader: 1.85 ms of "
    "those were the reader waiting for its next look at the replica's output ring (the "
    "replica's start frame had it take output as flowing, looked for 2 ms later without a "
    "wake-up). Of the rest, ~1 ms is file work (the cell's run directory, job file, module "
    "file and report, made and removed; each replica process's 1 MiB output ring, ~0.25 ms "
    "to make), the rest hand-overs between the notebook's threads and the replica's "
    "process. An empty cell takes the kernel ~2.5 ms. "
    "The widget view adds its messages: at N=1 it sent 11 (a display, "
    "its closing update, the static summary of the run it retires, and 8 widget updates: "
    "a retired run's widgets were cleared, then drawn again); now a short cell's widget is "
    "displayed once, at its end, on widgets drawn over, and sends 4 (the display, the "
    "retired run's summary, and what changed: the header): over the text view, 2.2 -> 1.0 "
    "ms a cell in a one-kernel A/B (measured once). Tried and not kept: skipping "
    "ipykernel's flush of stdout and stderr at each display (a wait on its IOPub thread) "
    "for the updates in place: no change beyond the noise; sending the cell from the reading "
    "thread instead of a driver thread per cell: 6.86 against 6.92 ms a text-view cell.")


# What A/B runs in one kernel showed (bench/peers.py's cell, 10 runs per variant, interleaved).
FIRST_LINE_PROFILE = (
    "Where the time goes at 4 and 8 replicas (measured once, outside this benchmark: A/B "
    "runs of this cell in one kernel, 10 per variant, interleaved): a line "
    "printed while the notebook still forks the later replicas waits for those forks. Each "
    "fork holds the GIL for ~8-12 ms while it copies the page tables of a notebook process "
    "with torch_xla imported (~400 MB of anonymous memory), and both the run's reading thread "
    "and ipykernel's IOPub thread need the GIL to pass the line on. Tried: a GIL switch "
    "interval of 0.2 ms (default 5) while forking: no change beyond the noise. Holding every "
    "replica until all are forked cut this measure to ~8-9 ms, but the first line a person "
    "sees came later (call to first line ~43 → ~82 ms at 4 replicas, ~45 → ~144 ms at 8), "
    "so it was not kept. Tried after it (A/B in one kernel, 12 runs per variant, "
    "interleaved): a launcher process per run, forked once by the notebook, forking the "
    "replicas itself, so that the notebook holds its GIL for one fork instead of N. First "
    "line 13.5 → 9.0 ms at 4 replicas and 19.2 → 15.8 at 8 (p90 37.7 → 37.4), for a launch "
    "14 and 3 ms longer; in a plain process (no ipykernel) the same change took the first "
    "line from 11.6 to 1.4 ms at 8. In the kernel the two cores stay busy with the forks "
    "and the replicas' start-up, which its threads compete with: not kept.")

# Where a one-off run's time goes: what each replica process costs (measured once, by hand).
ONE_OFF_PROFILE = (
    "Where a one-off run's time goes at 4 and 8 replicas (measured once, outside this "
    "benchmark): every replica process costs the two cores ~20 ms of CPU. In the kernel, "
    "`os.fork` takes ~6 ms (it copies the page tables of ~416 MB of anonymous memory, "
    "torch and torch_xla's imports mostly) and the child's exit and reaping ~12 ms; the "
    "replica itself ~7 ms (about 1,850 minor page faults from fork to exit, copy-on-write "
    "mostly: Python writes reference counts into pages it shares with the notebook; its "
    "Python code takes ~1 ms). multiprocessing flushes the notebook's stdout and stderr "
    "before each fork, a wait on ipykernel's IOPub thread: ~1 ms a process (`fork_each(8)` "
    "97 against 90 ms without it), kept, as it keeps text buffered in the notebook from "
    "being sent again from a child. So the one-off run stays near its own model's floor "
    "(`fork_each` above), and above bare `xmp.spawn`'s one process of N threads; a warm "
    "session forks nothing per cell.")


def render(res: dict, info: dict, seconds: float, args) -> str:
    L = ["## Peers: `%%xla_spawn` side by side", ""]
    L += [
        "The same module-level functions (`bench/peer_jobs.py`) run, in one real ipykernel per "
        "replica count (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=N), by: bare "
        "`xmp.spawn(fn, start_method='fork')` (the floor); `accelerate.notebook_launcher(fn, "
        "num_processes=N)` (here, off Colab/Kaggle TPUs, torch.distributed's elastic agent "
        "forks N worker processes; with N=1 it calls the function in the kernel); "
        "ipyparallel `%%px` on N engines started before timing (plain Python processes, no "
        "XLA runtime: the same Python work); `%%xla_spawn -n N` (text view, `--no-widget`, "
        "unless said). All times are measured in one run, from this benchmark process "
        "talking to the kernel as a notebook front end does.",
        "",
        "### 1. Launch overhead of a trivial cell",
        "",
        f"`fn` returns its index. ms from `execute_request` to `idle`, median (p10–p90) of "
        f"{args.repeats} runs interleaved (order rotating); ratio: median over the bare median. "
        "`notebook_launcher` with N=1 forks nothing (it calls the function in the kernel); "
        "`%%px` only sends the cell to engines that are already running.",
        "",
        "| peer | " + " | ".join(f"N={r['replicas']} ms | ratio" for r in res["launch"]) + " |",
        "|---|" + "---:|---:|" * len(res["launch"]),
    ]
    for p in LAUNCH_PEERS + ("px_beside_session",) + SESSION_PEERS:
        L.append(f"| {LABEL[p]} | " + " | ".join(
            f"{_ms(r['stats_ms'][p], 1)} | {r['ratio_of_medians'][p]:.2f}×"
            for r in res["launch"]) + " |")
    L += ["", "The last three rows come from a second loop of the same kernel: a session started "
              "with `%xla_session start -n N` (not timed), then `%%px` and the session's cells "
              "(`%%xla_spawn --no-widget` and `%%xla_spawn`, no `-n`: the session's replicas run "
              "them) interleaved, order rotating; the session is stopped before the next section.",
          "", "Goals (issue 18), at the median:"]
    for p, above in GOAL_ABOVE_FLOOR_MS.items():
        parts = [f"N={r['replicas']}: {r['minus_bare_ms'][p]['median']:+.1f} ms "
                 f"({'met' if r['minus_bare_ms'][p]['median'] <= above else 'not met'})"
                 for r in res["launch"]]
        L.append(f"- {LABEL[p]} within +{above:g} ms of the floor (paired difference): "
                 + "; ".join(parts) + ".")
    for p in ("xla", "xla_widget"):
        parts = [f"N={r['replicas']}: {r['minus_forks_ms'][p]['median']:+.1f} ms"
                 for r in res["launch"]]
        L.append(f"- (for comparison, not a goal) {LABEL[p]} above N forked processes, the "
                 "floor of its own model, one process per replica (paired difference): "
                 + "; ".join(parts) + ".")
    for p in SESSION_PEERS:
        parts = []
        for r in res["launch"]:
            mine, px = (r["stats_ms"][q]["median"] for q in (p, "px_beside_session"))
            parts.append(f"N={r['replicas']}: {mine:.1f} against {px:.1f} ms "
                         f"({'met' if mine < px else 'not met'})")
        L.append(f"- {LABEL[p]} faster than `%%px` beside it: " + "; ".join(parts) + ".")
    L += ["", "Where the widget view's time went (py-spy and cProfile of a kernel running "
              "`%%xla_spawn -n 8 index` repeatedly, before issue 18): making widgets. Each "
              "replica's tab was 3 widgets and a box, each with its own layout (and style, for "
              "the HTML ones): 89 widgets per run of 8, each a `comm_open` that serializes "
              "every trait of its model, plus ~30 updates (the Tab's children re-sent as each "
              "replica started; on ipywidgets 7, `set_title` re-sent every title per tab per "
              "tick), and as many `comm_close`s when the run was retired five runs later: "
              "~150 messages on the kernel's main thread, most of the launch's extra time. "
              "The summary bundle and the static HTML cost little. Now every widget of a run "
              "shares one layout and one style, a replica's error widget is made only if it "
              "fails, tabs are made at a tick in one change, titles are sent once when they "
              "change: 30 widgets and ~74 messages per run of 8. And a run retired five runs "
              "later (its display now its summary) no longer closes its widgets: the next run "
              "makes them over (A/B in one kernel, a warm session, measured once outside this "
              "benchmark: the widget view's cost over the text view went from +4.9 to +2.1 ms "
              "a cell at N=1, +9.6 to +3.2 ms at N=4).", "", ONE_OFF_PROFILE, "",
          SESSION_CELL_PROFILE]
    ups = ", ".join(f"N={x['replicas']}: {x['cluster_start_s']:.1f} s "
                    f"(+{x['engine_setup_s']:.1f} s imports and `index` on the engines)"
                    for x in res["sessions"])
    L += ["", f"ipyparallel start-up, not in the figures above (`ipp.Cluster(n=N)."
              f"start_and_connect_sync()` in the kernel): {ups}.", ""]

    L += ["### 2. First-output latency", "",
          f"Each replica prints `time.time()` at once, then sleeps {args.sleep:g} s; ms until "
          "this process receives the IOPub message carrying the line (`stream`; `%%px`: "
          "its output display), median (p10–p90) over every replica of "
          f"{args.latency_repeats} runs.", "",
          "| peer | " + " | ".join(f"N={r['replicas']} ms" for r in res["latency"]) + " |",
          "|---|" + "---:|" * len(res["latency"])]
    for p in PEERS:
        L.append(f"| {LABEL[p]} | " + " | ".join(
            _ms(r["stats_ms"][p]) + (f" ({r['missing'][p]} lines missing)"
                                     if r["missing"][p] else "")
            for r in res["latency"]) + " |")
    L += ["", FIRST_LINE_PROFILE, ""]

    L += throughput_lines(res["throughput"])

    r = res["return"]
    gib = r["bytes"] / (1 << 30)
    L += ["### 4. Result return", "",
          f"{r['replicas']} replicas each return a {r['mib']} MiB float32 tensor "
          f"({gib:g} GiB in all) into the kernel's namespace, checked. Wall s (median, "
          f"p10–p90 of {args.return_repeats} runs, interleaved); GB/s = 10⁹ bytes/s. *Return "
          "only*: the paired difference with the same job returning only the tensor's size "
          f"(making the tensor and launching cancel out). {MEMCPY_PROSE} (in the kernel, "
          f"{r['replicas']} × {r['mib']} MiB): **{r['memcpy_gb_s']:.1f} GB/s** "
          f"({ways_prose(r['memcpy_ways_s'], r['bytes'])}); return-only "
          "GB/s is also given as its share. After each run, untimed: its results are checked "
          "and freed (`del`; for `%%px`, also `rc.purge_local_results('all')`: ipyparallel's "
          "client keeps every result, 1 GiB a run in the kernel, which every later fork of it "
          "would copy). `%%xla_spawn` writes into the pages of the "
          "previous run's results (as a loop does; see "
          "[Result return](#result-return-large-tensors-from-the-replicas)); a session's "
          "replica writes into the pages it wrote before through its own mapping of them, "
          "a plain memory copy. The session's cells come in a second loop (a session is "
          "started after the first, not timed, and stopped after its cells).", "",
          "| peer | how | wall s | size-only wall s | end-to-end GB/s | return-only GB/s |",
          "|---|---|---:|---:|---:|---:|",
          f"| {LABEL['bare']} | — | cannot: `xmp.spawn` returns None (with "
          "`start_method='fork'` it discards the function's values) | | | |",
          f"| {LABEL['accelerate']} | — | cannot: `notebook_launcher` returns None | | | |"]
    how = {"px": "`dv.apply_sync(peer_jobs.tensor, ipp.Reference('index'), MiB)` "
                 "(`%%px` returns no values)",
           "xla": "`%%xla_spawn -o vals`",
           "xla_session": "`%%xla_spawn -o vals` on a session (`%xla_session start -n N`)"}
    for p in ("px", "xla", "xla_session"):
        x = r[p]
        ret_gb = f"{x['return_gb_s']:.2f}" if x["return_gb_s"] else "—"
        share = (f" ({x['return_gb_s'] / r['memcpy_gb_s']:.0%})" if x["return_gb_s"] else "")
        L.append(f"| {LABEL[p]} | {how[p]} | {_ms(x['return_s'], 2)} | "
                 f"{_ms(x['size_only_s'], 2)} | {x['end_to_end_gb_s']:.2f} | {ret_gb}{share} |")
    L.append("")

    it = res["interrupt"]
    L += ["### 5. Interrupt to clean", "",
          f"{it['cycles']} cycles per peer, {it['replicas']} replicas: a job that runs until "
          "stopped; once every replica has written its start marker, SIGINT to the kernel's "
          "process group (`KernelManager.interrupt_kernel()`, as Jupyter's Interrupt). "
          "*Clean*: s from the first SIGINT until no process the run started is alive "
          "(`%%px`: until no engine is busy), median (p10–p90) of the clean cycles; *never*: "
          f"not within {it['cap_s']:g} s of the last interrupt. *Kernel back*: until the "
          f"cell's `execute_reply`. If the kernel is still busy {it['cap_s']:g} s after an "
          f"interrupt, it gets another (as a person presses again; up to "
          f"{it['max_interrupts']} per cycle). *Left*: processes of the runs still alive after "
          "all cycles (then killed by pid).", "",
          "| peer | clean cycles | clean s | kernel back s | interrupts pressed | left after "
          f"{it['cycles']} | notes |",
          "|---|---:|---:|---:|---:|---:|---|"]
    for p in PEERS:
        x = it[p]
        notes = [f"{x['cycles'][0]['processes']} process(es) per run"]
        outcomes = sorted({f"`{c['ename']}`" if c["ename"] else
                           "no error" if c["status"] == "ok" else str(c["status"])
                           for c in x["cycles"]})
        notes.append("the cell ends with " + ", ".join(outcomes))
        stuck = sum(c["interrupts"] > 1 for c in x["cycles"])
        if stuck:
            notes.append(f"kernel still busy {it['cap_s']:g} s after the first interrupt in "
                         f"{stuck}/{it['cycles']} cycles")
        alive_end = sum(c["alive_at_end"] for c in x["cycles"])
        if alive_end:
            notes.append(f"{alive_end} process(es) alive at the ends of their cycles")
        if x["killed_by_benchmark"]:
            notes.append(f"kernel hung: the benchmark killed {x['killed_by_benchmark']} "
                         "process(es)")
        if x["kernel_restarts"]:
            notes.append(f"{x['kernel_restarts']} kernel restart(s)")
        if p == "px":
            notes.append(f"{x['busy_engines_after']} engine(s) busy after; the engines stay "
                         "up by design")
        clean = _ms(x["clean_s"], 3) if x["clean_s"] else "never"
        L.append(f"| {LABEL[p]} | {x['clean']}/{it['cycles']} | {clean} | "
                 f"{_ms(x['kernel_back_s'], 3)} | {x['interrupts']} | {x['left_after']} | "
                 f"{'; '.join(notes)} |")
    L += ["", machine_line(
        info, NAME, seconds,
        f"launch {args.repeats} repeats, latency {args.latency_repeats}, return "
        f"{args.return_repeats}, {it['cycles']} interrupts per peer",
        packages=f"accelerate {info['accelerate']}, ipyparallel {info['ipyparallel']}, "
                 f"ipykernel {info['ipykernel']}")]
    return "\n".join(L)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--replicas", default="1,4,8",
                        help="replica counts for launch and latency (1,4,8)")
    parser.add_argument("--repeats", type=int, default=15, help="launch runs per peer (15)")
    parser.add_argument("--warmups", type=int, default=1, help="untimed launch runs (1)")
    parser.add_argument("--latency-repeats", type=int, default=5,
                        help="latency runs per peer (5)")
    parser.add_argument("--sleep", type=float, default=0.5,
                        help="s each replica sleeps after its stamped line (0.5)")
    parser.add_argument("--throughput-replicas", type=int, default=8, help="(8)")
    parser.add_argument("--lines", type=int, default=100_000, help="lines per replica (100000)")
    parser.add_argument("--throughput-repeats", type=int, default=3, help="(3)")
    parser.add_argument("--slow-lines", type=int, default=500,
                        help="lines per replica for the peers that print from forked "
                             "children straight to ipykernel (500)")
    parser.add_argument("--return-replicas", type=int, default=4, help="(4)")
    parser.add_argument("--return-mib", type=int, default=256, help="MiB per replica (256)")
    parser.add_argument("--return-repeats", type=int, default=3, help="(3)")
    parser.add_argument("--interrupt-replicas", type=int, default=8, help="(8)")
    parser.add_argument("--interrupts", type=int, default=10, help="cycles per peer (10)")
    parser.add_argument("--interrupt-cap", type=float, default=3.0,
                        help="s to wait after an interrupt before the next (3)")
    parser.add_argument("--max-interrupts", type=int, default=2,
                        help="interrupts per cycle before the benchmark kills the run (2)")
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="s a throughput cell may take (300)")
    parser.add_argument("--only-throughput", action="store_true",
                        help="section 3 alone: print its table (results.md is not written)")
    args, _ = parser.parse_known_args(argv)  # bench/run passes every benchmark's options
    counts = replica_counts(args.replicas)
    if (args.repeats < 2 or args.latency_repeats < 1 or args.return_repeats < 2
            or not counts or min(counts) < 1 or args.interrupts < 1
            or not 1 <= args.throughput_replicas <= 10):
        parser.error("need --repeats >= 2, --return-repeats >= 2, replica counts >= 1, "
                     "1 <= --throughput-replicas <= 10 (one-digit ordinals)")

    if args.only_throughput:
        s = Session(args.throughput_replicas)
        try:
            t = measure_throughput(s, args.lines, args.slow_lines, args.throughput_repeats,
                                   args.deadline)
        finally:
            s.close()
        print("\n".join(throughput_lines(t)))
        return 0
    started = time.perf_counter()
    info = machine_info(args.repeats, args.warmups)
    for dist in ("accelerate", "ipyparallel", "ipykernel"):
        info[dist] = importlib.metadata.version(dist)
    res: dict = {"sessions": [], "launch": [], "latency": []}
    wanted = sorted(set(counts) | {args.throughput_replicas, args.return_replicas,
                                   args.interrupt_replicas})
    for n in wanted:
        t0 = time.perf_counter()
        s = Session(n, engine_torch=n == args.return_replicas)
        try:
            res["sessions"].append({"replicas": n, "kernel_start_s": s.kernel_start_s,
                                    "setup_s": s.setup_s, "cluster_start_s": s.cluster_start_s,
                                    "engine_setup_s": s.engine_setup_s})
            if n in counts:
                res["launch"].append(measure_launch(s, args.repeats, args.warmups))
                res["latency"].append(measure_latency(s, args.latency_repeats, args.sleep))
            if n == args.throughput_replicas:
                res["throughput"] = measure_throughput(s, args.lines, args.slow_lines,
                                                       args.throughput_repeats, args.deadline)
            if n == args.return_replicas:
                res["return"] = measure_return(s, args.return_mib, args.return_repeats)
            if n == args.interrupt_replicas:
                res["interrupt"] = measure_interrupt(s, args.interrupts, args.interrupt_cap,
                                                     args.max_interrupts)
        finally:
            s.close()
        print(f"peers: N={n} done [{time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    seconds = time.perf_counter() - started
    markdown = render(res, info, seconds, args)
    return publish(NAME, markdown, {"machine": info, "seconds": seconds,
                                    "args": vars(args), **res}, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
