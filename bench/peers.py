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

6. warm groups (issue 35), at every ``--replicas`` count: the peers that keep N processes
   warm for cell after cell, each in a kernel of its own, all up at once, used in turns
   (order rotating): ``%xla_session`` (text and widget view, and a plain cell beside it: the
   floor), ipyparallel ``%%px``, nbdistributed 0.1.0 (``%dist_init -n N``: every plain cell
   then runs on its workers) and jupyter-distributed 0.1.1 (its kernel,
   ``python -m jupyter_distributed.kernel`` with ``JUPYTER_DISTRIBUTED_WORLD_SIZE=N``, seen as
   text or with its rank tabs' live-update comm open): start (s to a ready group), a warm
   ``x = 1`` (after a few warm-up rounds: the widget view's first cell in a kernel makes its
   widgets, a row of their own), ``--group-lines`` lines per
   replica (lines lost), a raise in one replica (time to the error shown; does it name the
   replica and line), interrupt to reply (does the group survive), an all_reduce without
   set-up ("cannot" where a peer has no collectives).
   nbdistributed's workers are stopped by pid through its ``ProcessManager``, never with its
   ``%dist_shutdown``/``%dist_reset`` (they kill by name pattern machine-wide).

Writes the "peers" section of results.md and results/peers.json, then section 6 as the
"peer_groups" section and results/peer_groups.json (``--no-groups``: not run;
``--only-groups``: only it).

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
from output_throughput import (Kernel, RssSampler, check_logs, run_magic,  # noqa: E402
                               run_streamed, split_lines, summarize, tally)


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


# --- 6. warm groups: %xla_session beside ipyparallel, nbdistributed, jupyter-distributed ----------
#
# Issue 35: every peer that keeps N processes warm for cell after cell, in a kernel of its own,
# on the same work, interleaved (order rotating). A *variant* is what a user types and sees:
# the session's text view (``%%xla_spawn --no-widget``) and widget view (``%%xla_spawn``), a
# plain cell in the session's kernel (the floor of a warm cell), ``%%px``, nbdistributed's
# distributed mode (every plain cell runs on its workers) and jupyter-distributed's kernel
# (every cell runs on its rank kernels), seen as text (its display's text/plain) or as its
# rank tabs (JupyterLab's renderer, which subscribes to the kernel's live-update comm).

GROUP_NAME = "peer_groups"
GROUPS = ("session", "px", "nbd", "jd")
VARIANT_GROUP = {"plain": "session", "xla": "session", "xla_widget": "session", "px": "px",
                 "nbd": "nbd", "jd": "jd", "jd_tabs": "jd"}
GROUP_LABEL = {
    "session": "`%xla_session start -n N`", "px": "ipyparallel `ipp.Cluster(n=N)`",
    "nbd": "nbdistributed `%dist_init -n N`",
    "jd": "jupyter-distributed kernel (`JUPYTER_DISTRIBUTED_WORLD_SIZE=N`)",
    "plain": "plain `x = 1`, no magic (session's kernel: the floor)",
    "xla": "`%%xla_spawn --no-widget` on the session (text view)",
    "xla_widget": "`%%xla_spawn` on the session (widget view)",
    "jd_tabs": "jupyter-distributed, rank tabs (its live-update comm open, as JupyterLab's "
               "renderer)"}
ROW_LABEL = dict(GROUP_LABEL, px="ipyparallel `%%px`",
                 nbd="nbdistributed (distributed mode: a plain cell on every worker)",
                 jd="jupyter-distributed, text (its display's text/plain)")
# Which variants each measure runs (where a user sees output, both of a peer's views).
GROUP_ROWS = {
    "warm": ("plain", "xla", "xla_widget", "px", "nbd", "jd"),
    "lines": ("xla", "xla_widget", "px", "nbd", "jd", "jd_tabs"),
    "raise": ("xla", "xla_widget", "px", "nbd", "jd", "jd_tabs"),
    "interrupt": ("xla", "xla_widget", "px", "nbd", "jd"),
    "allreduce": ("xla", "xla_widget", "nbd"),
}
# Warm-up rounds of the warm cell: the widget view's first run in a kernel makes its widgets,
# every later one makes the ended run's over (views/widget.py); a few more for the caches.
WARM_ROUNDS = 3
CANNOT_ALLREDUCE = {
    "px": "cannot: engines are plain processes with no process group (the user sets up MPI "
          "or `torch.distributed` on them)",
    "jd": "cannot: it sets torchrun's variables but makes no process group (its README: "
          "`dist.init_process_group('gloo')` is the notebook's to call)"}
RANK_UPDATES_TARGET = "jupyter.distributed.rank_updates"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TAG = re.compile(r"<[^>]+>")
_JD_HEADER = re.compile(r"^\[Rank (\d+) — [a-z]+\]$")
_NBD_HEADER = re.compile(r"^🔹 Rank \d+:$")
_LOGS = re.compile(r"full logs: (?:<code>)?([^\s<\"\\]+)")


def visible_text(msg: dict) -> str:
    """What a person can read of one IOPub message (ANSI and HTML tags stripped)."""
    kind, content = msg["msg_type"], msg["content"]
    parts: List[str] = []
    if kind == "stream":
        parts.append(content["text"])
    elif kind == "error":
        parts += [content.get("ename", ""), content.get("evalue", "")]
        parts += content.get("traceback", [])
    elif kind in ("display_data", "update_display_data", "execute_result"):
        data = content.get("data", {})
        parts.append(data.get("text/plain", "") if "text/html" not in data
                     else data["text/html"])
    elif kind in ("comm_msg", "comm_open"):
        def walk(value):
            if isinstance(value, str):
                parts.append(value)
            elif isinstance(value, dict):
                for key, v in value.items():
                    if key not in ("_view_module", "_model_module", "layout", "style"):
                        walk(v)
            elif isinstance(value, list):
                for v in value:
                    walk(v)
        walk(content.get("data", {}))
    return _TAG.sub("", _ANSI.sub("", "\n".join(p for p in parts if isinstance(p, str))))


class JdKernel(Kernel):
    """jupyter-distributed's kernel, as its server extension swaps it in for a notebook's
    kernel: ``python -m jupyter_distributed.kernel`` with ``JUPYTER_DISTRIBUTED_WORLD_SIZE``.
    It starts its N rank kernels on the first request (``wait_for_ready``'s kernel_info)."""

    def __init__(self, replicas: int):
        import json

        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(replicas),
                   JUPYTER_DISTRIBUTED_WORLD_SIZE=str(replicas))
        self.ipc_dir = tempfile.mkdtemp(prefix="colab_xla-bench-jd-")
        spec = os.path.join(self.ipc_dir, "kernels", "jupyter-distributed")
        os.makedirs(spec)
        with open(os.path.join(spec, "kernel.json"), "w") as f:
            json.dump({"argv": [sys.executable, "-m", "jupyter_distributed.kernel", "-f",
                                "{connection_file}"],
                       "display_name": "jupyter-distributed", "language": "python",
                       # as its server extension sets it: Interrupt is an interrupt_request
                       # message, which it passes on to every rank kernel
                       "interrupt_mode": "message"}, f)
        self.km = KernelManager(
            kernel_name="jupyter-distributed", transport="ipc",
            kernel_spec_manager=KernelSpecManager(
                kernel_dirs=[os.path.join(self.ipc_dir, "kernels")]),
            ip=os.path.join(self.ipc_dir, "kernel"),
            connection_file=os.path.join(self.ipc_dir, "kernel.json"))
        self.km.start_kernel(env=env, cwd=BENCH_DIR)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=300)
        self.pid = self.km.provisioner.pid
        self.executable = sys.executable

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)  # its do_shutdown stops the rank kernels
        finally:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


class Group:
    """One peer's N warm processes in a kernel of its own: started, used, stopped by pid."""

    name = ""

    def __init__(self, n: int):
        self.n = n
        self.k: Optional[Kernel] = None
        self.started = False

    # what a user types: the same work in every peer's own form
    def cell(self, variant: str, body: str) -> str:
        return body

    def ok(self, r: dict, text: str) -> bool:
        """Whether a cell that should work did (reply ok, no error shown)."""
        return r["status"] == "ok" and not r["timed_out"]

    noop = "1"  # a cell that runs in the kernel itself

    def setup(self) -> None:
        """The kernel's own set-up (after it started)."""

    def recover(self) -> None:
        """After a cell ran past its deadline: interrupt; if the kernel stays busy, restart it
        (the processes it started are killed by pid) and set it up again."""
        procs = list(self.descendants().values())
        self.k.km.interrupt_kernel()
        r = self.k.execute(self.noop, deadline=40, grace=0.0)
        if r["status"] == "ok" and not r["timed_out"]:
            return
        self.k.km.restart_kernel(now=True)
        self.k.kc.wait_for_ready(timeout=300)
        self.k.pid = self.k.km.provisioner.pid
        kill(procs)
        self.started = self.name == "jd"  # its kernel is its group
        self.setup()

    def run(self, code: str, deadline: float = 120, ok: bool = True, **kw) -> dict:
        r = self.k.execute(code, deadline=deadline, grace=kw.pop("grace", 0.0), **kw)
        if r["timed_out"]:
            self.recover()
        if ok and (r["status"] != "ok" or r["timed_out"]):
            raise RuntimeError(f"{self.name} N={self.n}: {code[:200]!r} -> {r['status']} "
                               f"{r['error']}{' (timed out)' if r['timed_out'] else ''}:\n"
                               f"{r['stdout'][-1500:]}\n{r['stderr'][-1500:]}")
        return r

    def descendants(self) -> Dict[int, psutil.Process]:
        found = {}
        if self.k is not None:
            with contextlib.suppress(psutil.Error):
                for proc in psutil.Process(self.k.pid).children(recursive=True):
                    found[proc.pid] = proc
        return found

    def start(self) -> float:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart(self) -> float:
        if self.started:
            self.stop()
        return self.start()

    def close(self) -> None:
        procs = list(self.descendants().values())
        with contextlib.suppress(Exception):
            if self.started:
                self.stop()
        if self.k is not None:
            with contextlib.suppress(Exception):
                self.k.shutdown()
        kill(procs)  # whatever outlived its peer's own stop: ours, by pid


class KernelGroup(Group):
    """A group in a plain ipykernel, started with it; its set-up imports ``peer_jobs`` and
    then runs :attr:`SETUP`."""

    SETUP = ""

    def __init__(self, n: int):
        super().__init__(n)
        self.k = Kernel(n)
        self.setup()

    def setup(self) -> None:
        self.run(f"import sys, time\nsys.path.insert(0, {BENCH_DIR!r})\nimport peer_jobs\n"
                 + self.SETUP, deadline=180)


class SessionGroup(KernelGroup):
    name = "session"
    SETUP = "get_ipython().run_line_magic('load_ext', 'colab_xla')"

    def cell(self, variant: str, body: str) -> str:
        if variant == "plain":
            return body
        return ("%%xla_spawn --no-widget\n" if variant == "xla" else "%%xla_spawn\n") + body

    def start(self) -> float:
        s = self.run(f"%xla_session start -n {self.n}", deadline=300)["idle_s"]
        self.started = True
        self.run(self.cell("xla", "x = 1"), deadline=300)  # untimed: imports, compiles
        return s

    def stop(self) -> None:
        self.started = False
        self.run("%xla_session stop", deadline=120, ok=False)


class PxGroup(KernelGroup):
    name = "px"
    IMPORTS = "import sys; sys.path.insert(0, {bench!r}); import peer_jobs"
    SETUP = "import ipyparallel as ipp"

    def cell(self, variant: str, body: str) -> str:
        return "%%px\n" + body

    def start(self) -> float:
        # As ipyparallel's docs start a cluster from a notebook: ready once N engines are up.
        s = self.run(f"cluster = ipp.Cluster(n={self.n})\n"
                     "rc = cluster.start_and_connect_sync()\ndv = rc[:]", deadline=300)["idle_s"]
        # %%px stays bound to the first client's view: bind it to this cluster's, as the
        # first client does (untimed)
        self.run("rc.activate()")
        self.started = True
        self.run(f"assert sorted(rc.ids) == list(range({self.n})), rc.ids\n"
                 f"dv.execute({self.IMPORTS.format(bench=BENCH_DIR)!r}, block=True)\n"
                 "for _i in rc.ids:\n    rc[_i].push(dict(index=_i), block=True)",
                 deadline=300)
        return s

    def stop(self) -> None:
        self.started = False
        self.run("rc.close(); cluster.stop_cluster_sync()", deadline=120, ok=False)


class NbdGroup(KernelGroup):
    """nbdistributed: ``%dist_init -n N`` starts N workers (``python`` from PATH, its worker
    script; each makes a gloo process group) and turns on distributed mode (a plain cell runs
    on every worker). Its ``%dist_shutdown``/``%dist_reset`` kill by name pattern machine-wide
    and ``killpg`` the kernel's group: never called. Workers are stopped by pid, through its
    ``ProcessManager``'s Popen objects; local work goes through ``%%bench_local`` (a magic
    cell: distributed mode leaves those to the kernel)."""

    name = "nbd"
    SETUP = """\
from IPython.core.magic import register_cell_magic

@register_cell_magic
def bench_local(line, cell):
    exec(compile(cell, "<bench_local>", "exec"), get_ipython().user_ns)

get_ipython().run_line_magic("load_ext", "nbdistributed")
_nbd = get_ipython().magics_manager.registry["DistributedMagic"]"""
    # %dist_init returns after a fixed 2 s sleep, before the workers (which import torch and
    # make a gloo group first) have connected: a cell sent then is dropped by its ROUTER
    # socket and waits for its 30 s timeout. Wait until every worker answers.
    WAIT = """\
%%bench_local
while True:
    try:
        _nbd._comm_manager.send_to_all("get_status", {}, timeout=0.25)
        break
    except TimeoutError:
        pass"""
    STOP = """\
%%bench_local
_cm, _pm = _nbd._comm_manager, _nbd._process_manager
if _cm is not None:
    _cm.running = False
    _cm.handler_thread.join()
    _cm.coordinator_socket.close(linger=0)
    _cm.context.term()
if _pm is not None:
    for _p in _pm.processes:
        _p.kill()
    for _p in _pm.processes:
        _p.wait()
_nbd._comm_manager = _nbd._process_manager = None
_nbd._num_processes = 0
_nbd._disable_distributed_mode()"""

    noop = "%%bench_local\npass"
    ALIVE = ("%%bench_local\nprint('alive', sum(_p.poll() is None for _p in "
             "(_nbd._process_manager.processes if _nbd._process_manager else ())))")

    def recover(self) -> None:
        super().recover()
        if self.started:  # an interrupt reaches its workers too (the kernel's process group)
            got = re.search(r"alive (\d+)", self.run(self.ALIVE, ok=False)["stdout"])
            if not got or int(got.group(1)) < self.n:
                self.restart()

    def ok(self, r: dict, text: str) -> bool:
        return super().ok(r, text) and "Error executing distributed code" not in text

    def start(self) -> float:
        r = self.run(f"%dist_init -n {self.n}", deadline=300)
        if "Successfully started" not in r["stdout"]:
            raise RuntimeError(f"nbdistributed: %dist_init: {r['stdout'][-2000:]}")
        self.started = True
        s = r["idle_s"] + self.run(self.WAIT, deadline=300)["idle_s"]
        got = self.run(f"import sys\nsys.path.insert(0, {BENCH_DIR!r})\nimport peer_jobs\n"
                       "index = rank")
        if "Error" in got["stdout"]:
            raise RuntimeError(f"nbdistributed: set-up cell: {got['stdout'][-2000:]}")
        return s

    def stop(self) -> None:
        self.started = False
        self.run(self.STOP, deadline=60, ok=False)


class JdGroup(Group):
    """jupyter-distributed: its kernel is the group (it starts N rank kernels, ipykernels,
    with torchrun's variables); started again by starting the kernel again."""

    name = "jd"

    def start(self) -> float:
        t0 = time.perf_counter()
        self.k = JdKernel(self.n)
        s = time.perf_counter() - t0
        self.started = True
        self.setup()
        return s

    def setup(self) -> None:
        self.run(f"import os, sys\nsys.path.insert(0, {BENCH_DIR!r})\nimport peer_jobs\n"
                 "index = int(os.environ['RANK'])")

    def stop(self) -> None:
        self.started = False
        procs = list(self.descendants().values())
        with contextlib.suppress(Exception):
            self.k.shutdown()
        self.k = None
        kill(procs)

    def ok(self, r: dict, text: str) -> bool:
        return super().ok(r, text) and "RankProcessError" not in text

    def open_tabs(self) -> str:
        """Subscribe to the live rank updates, as the JupyterLab renderer does; the comm's id."""
        import uuid

        kc = self.k.kc
        comm_id = uuid.uuid4().hex
        msg = kc.session.msg("comm_open", {"comm_id": comm_id, "data": {},
                                           "target_name": RANK_UPDATES_TARGET})
        kc.shell_channel.send(msg)
        stop_at = time.monotonic() + 30
        while time.monotonic() < stop_at:  # its first snapshot: subscribed
            with contextlib.suppress(queue.Empty):
                m = kc.get_iopub_msg(timeout=0.1)
                if (m["parent_header"].get("msg_id") == msg["header"]["msg_id"]
                        and m["msg_type"] == "comm_msg"):
                    return comm_id
        raise RuntimeError("jupyter-distributed: no snapshot on its rank-updates comm")

    def close_tabs(self, comm_id: str) -> None:
        kc = self.k.kc
        kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": comm_id, "data": {}}))


def make_group(name: str, n: int) -> Group:
    return {"session": SessionGroup, "px": PxGroup, "nbd": NbdGroup, "jd": JdGroup}[name](n)


def run_variant(groups: Dict[str, Group], variant: str, body: str, deadline: float,
                ok: bool = False, keep: Optional[List[tuple]] = None) -> dict:
    """``body`` as ``variant``'s cell: the reply, its IOPub messages (``keep``: appended with
    their arrival, s after the request) and the text a person sees."""
    g = groups[VARIANT_GROUP[variant]]
    tabs = g.open_tabs() if variant == "jd_tabs" else None
    msgs: List[tuple] = [] if keep is None else keep
    t0 = time.time()
    try:
        r = g.run(g.cell(variant, body), deadline=deadline, ok=ok,
                  on_message=lambda m, arrived: msgs.append((m, arrived - t0)))
    finally:
        if tabs is not None:
            g.close_tabs(tabs)
    r["text"] = "\n".join(visible_text(m) for m, _ in msgs)
    r["works"] = g.ok(r, r["text"])
    return r


def group_lines(variant: str, msgs: List[tuple], n: int, lines: int) -> dict:
    """Lines of ``r{index} line {i}`` that reached the notebook, per the peer's own view."""
    if variant in ("xla", "xla_widget"):  # the session's full logs (its views show the first)
        found = None
        for m, _ in msgs:
            hit = _LOGS.search(visible_text(m)) or _LOGS.search(str(m["content"]))
            if hit:
                found = hit.group(1)
        if found and os.path.isdir(found):
            counts = check_logs(found, n, lines)
            shutil.rmtree(found, ignore_errors=True)
            return {**counts, "counted_from": "full logs"}
        c = tally([], n, lines)
        for m, _ in msgs:
            if m["msg_type"] == "stream":
                tally([x.split("] ", 1)[-1] for x in split_lines(m["content"]["text"])
                       if "line" in x], n, lines, counts=c)
        return {**summarize(c, n, lines), "counted_from": "stream (no full logs)"}
    c = tally([], n, lines)
    if variant == "px":  # the last update of each engine's stdout display
        final: Dict[str, str] = {}
        for m, _ in msgs:
            if m["msg_type"] in ("display_data", "update_display_data"):
                text = m["content"].get("data", {}).get("text/plain", "")
                key = m["content"].get("transient", {}).get("display_id") or f"a{len(final)}"
                if _PX_PREFIX.match(text):
                    final[key] = text
        for text in final.values():
            hit = _PX_PREFIX.match(text)
            tally(split_lines(text[hit.end():]), n, lines, owner=int(hit.group(1)), counts=c)
    elif variant == "nbd":  # its stream: "🔹 Rank K:" headers, then "  line" per line
        text = "".join(m["content"]["text"] for m, _ in msgs if m["msg_type"] == "stream"
                       and m["content"]["name"] == "stdout")
        tally([x.strip() for x in split_lines(text) if x.strip()
               and not _NBD_HEADER.match(x.strip())], n, lines, counts=c)
    else:  # jupyter-distributed: its last display's text/plain, "[Rank K — status]" sections
        last = ""
        for m, _ in msgs:
            if m["msg_type"] in ("display_data", "update_display_data"):
                last = m["content"].get("data", {}).get("text/plain", last)
        owner = None
        for x in split_lines(last):
            hit = _JD_HEADER.match(x)
            if hit:
                owner = int(hit.group(1))
            elif x:
                tally([x], n, lines, owner=owner, counts=c)
    return {**summarize(c, n, lines), "counted_from": "notebook messages"}


class _Phases:
    """Progress on stderr: each phase's seconds as it ends."""

    def __init__(self, what: str):
        self.what, self.last = what, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        print(f"{self.what}: {phase} [{now - self.last:.1f} s]", file=sys.stderr)
        self.last = now


def measure_groups_once(n: int, args) -> dict:
    """Every measure of section 6 at N=n: the four groups up at once, each in its kernel."""
    groups: Dict[str, Group] = {}
    out: dict = {"replicas": n, "start_s": {g: [] for g in GROUPS}}
    phase = _Phases(f"peers: groups N={n}")
    try:
        for name in GROUPS:
            groups[name] = make_group(name, n)
        phase("made")
        for i in range(args.group_starts):  # start: time to a ready group of N, rotating
            for name in rotated(GROUPS, i):
                out["start_s"][name].append(groups[name].restart())
        phase("starts")
        variants = GROUP_ROWS["warm"]
        warm: Dict[str, List[float]] = {v: [] for v in variants}
        # Warm-up rounds, kept as a row of their own: a kernel's first widget cells made
        # their run's widgets (a comm message each: 30 at 8 replicas) before a cell that
        # prints nothing and ends before its first draw, as `x = 1`, was shown as its
        # summary alone (no widget); later ones made a retired run's over.
        first: List[float] = []
        for i in range(WARM_ROUNDS):
            for v in rotated(variants, i):
                ms = run_variant(groups, v, "x = 1", 60, ok=True)["idle_s"] * 1e3
                if v == "xla_widget":
                    first.append(ms)
        out["first_widget_ms"] = first
        for i in range(args.group_repeats):
            for v in rotated(variants, i):
                warm[v].append(run_variant(groups, v, "x = 1", 60, ok=True)["idle_s"] * 1e3)
        out["warm_ms"] = warm
        phase("warm cells")
        out["lines"] = measure_group_lines(groups, n, args)
        phase("lines")
        out["raise"] = measure_group_raise(groups, n, args)
        phase("raise")
        out["allreduce"] = measure_group_allreduce(groups, n, args)
        phase("all_reduce")
        out["interrupt"] = measure_group_interrupt(groups, n, args)
        phase("interrupts")
    finally:
        for g in groups.values():
            g.close()
        phase("closed")
    out["stats"] = {
        "start_s": {g: stats(v) for g, v in out["start_s"].items()},
        "warm_ms": {v: stats(x) for v, x in out["warm_ms"].items()},
        "first_widget_ms": stats(out["first_widget_ms"])}
    return out


def measure_group_lines(groups, n: int, args) -> dict:
    variants, runs = GROUP_ROWS["lines"], {v: [] for v in GROUP_ROWS["lines"]}
    for v in variants:  # warm-up, small
        run_variant(groups, v, "peer_jobs.printer(index, 10)", 60)
    for i in range(args.group_lines_repeats):
        for v in rotated(variants, i):
            msgs: List[tuple] = []
            r = run_variant(groups, v, f"peer_jobs.printer(index, {args.group_lines})",
                            args.deadline, keep=msgs)
            counts = group_lines(v, msgs, n, args.group_lines)
            counts.pop("mixed_examples", None)
            runs[v].append({"wall_s": r["idle_s"], "works": r["works"], "status": r["status"],
                            "timed_out": r["timed_out"], "messages": len(msgs), **counts,
                            "error_text": "" if r["works"] else r["text"][-300:]})
    return {"lines": args.group_lines, "runs": runs,
            "wall_s": {v: stats([x["wall_s"] for x in rs if x["wall_s"] is not None])
                       for v, rs in runs.items()},
            "lost": {v: sum(x["lost"] for x in rs) for v, rs in runs.items()},
            "expected": {v: sum(x["expected"] for x in rs) for v, rs in runs.items()}}


RAISE_BODY = "if index == {k}:\n    raise ValueError('boom')"


def measure_group_raise(groups, n: int, args) -> dict:
    k = n - 1  # the last replica raises; the others return at once
    named = re.compile(rf"(?i)\b(replica|rank|engine)\W{{0,3}}{k}\b|\[{k}:")
    line = re.compile(r"\bline [23]\b")
    variants, runs = GROUP_ROWS["raise"], {v: [] for v in GROUP_ROWS["raise"]}
    for i in range(args.group_raise_repeats):
        for v in rotated(variants, i):
            msgs: List[tuple] = []
            r = run_variant(groups, v, RAISE_BODY.format(k=k), 120, keep=msgs)
            shown = next((t for m, t in msgs if "boom" in visible_text(m)), None)
            text = r["text"]
            at = text.find("boom")
            runs[v].append({"shown_s": shown, "idle_s": r["idle_s"], "status": r["status"],
                            "error": r["error"], "names_replica": bool(named.search(text)),
                            "names_line": bool(line.search(text)),
                            "excerpt": text[max(0, at - 700):at + 300]})
    return {"raising_replica": k, "body": RAISE_BODY.format(k=k), "runs": runs,
            "shown_s": {v: stats([x["shown_s"] for x in rs if x["shown_s"] is not None])
                        for v, rs in runs.items()}}


def allreduce_body(variant: str, n: int) -> str:
    if variant == "nbd":  # its workers made a gloo group at start: `dist` is there
        return ("_t = torch.tensor([index + 1.0])\ndist.all_reduce(_t)\n"
                "print(f'allreduce {float(_t[0])}')")
    return ("import torch, torch_xla.core.xla_model as xm\n"
            "_t = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([index + 1.0], device=device))\n"
            "print(f'allreduce {float(_t.cpu()[0])}')")


def measure_group_allreduce(groups, n: int, args) -> dict:
    want = f"allreduce {float(n * (n + 1) // 2)}"
    variants = GROUP_ROWS["allreduce"]
    samples: Dict[str, List[float]] = {v: [] for v in variants}
    right: Dict[str, int] = {v: 0 for v in variants}
    for v in variants:  # warm-up: the session compiles its first all_reduce
        run_variant(groups, v, allreduce_body(v, n), 300)
    for i in range(args.group_repeats):
        for v in rotated(variants, i):
            r = run_variant(groups, v, allreduce_body(v, n), 120)
            samples[v].append(r["idle_s"] * 1e3 if r["idle_s"] is not None else float("nan"))
            right[v] += r["works"] and want in r["text"]
    return {"want": want, "bodies": {v: allreduce_body(v, n) for v in variants},
            "samples_ms": samples, "right": right, "runs": args.group_repeats,
            "stats_ms": {v: stats([x for x in s if x == x]) for v, s in samples.items()},
            "cannot": CANNOT_ALLREDUCE}


def group_interrupt_cycle(groups, variant: str, n: int, args, last: bool = False) -> dict:
    """One Interrupt of ``variant``'s group in a cell that sleeps on every process, and
    whether the group survives it (started again if not, unless this is its ``last``
    cycle)."""
    g = groups[VARIANT_GROUP[variant]]
    kc, km = g.k.kc, g.k.km
    marker_dir = tempfile.mkdtemp(prefix="peers-groups-")
    msg_id = kc.execute(g.cell(variant, f"peer_jobs.forever(index, {marker_dir!r})"))
    t_start = time.monotonic()
    while len(os.listdir(marker_dir)) < n and time.monotonic() - t_start < 60:
        time.sleep(0.005)  # waiting for every replica's marker file
    c = {"started": len(os.listdir(marker_dir)), "interrupts": 0, "reply_s": None,
         "status": None, "ename": None}
    before = {pid for pid, p in g.descendants().items() if alive(p)}
    t0 = time.time()
    while c["interrupts"] < args.max_interrupts and c["reply_s"] is None:
        km.interrupt_kernel()
        c["interrupts"] += 1
        last = time.time()
        while c["reply_s"] is None and time.time() - last < args.interrupt_cap:
            with contextlib.suppress(queue.Empty):
                reply = kc.get_shell_msg(timeout=0.002)
                if reply["parent_header"].get("msg_id") == msg_id:
                    c["reply_s"] = time.time() - t0
                    c["status"] = reply["content"]["status"]
                    c["ename"] = reply["content"].get("ename")
    if c["reply_s"] is None:
        g.recover()
    time.sleep(0.2)  # the rest of the interrupted cell's messages
    with contextlib.suppress(queue.Empty):
        while True:
            kc.get_iopub_msg(timeout=0.05)
    # The group survives if the next cell works on it, on the same processes. One whose
    # processes are gone already has not: its next cell is not sent (it would wait out its
    # deadline, and the kernel's recovery after it, for an answer that cannot change it).
    gone = before - {pid for pid, p in g.descendants().items() if alive(p)}
    if gone:
        nxt = {"works": False, "idle_s": None,
               "text": f"not sent: {len(gone)} process(es) of the group gone"}
        g.recover()  # (what the next cell's time-out would have done)
    else:
        nxt = run_variant(groups, variant, "x = 1", args.group_next_deadline)
    living = {pid for pid, p in g.descendants().items() if alive(p)}
    gone |= before - living
    c.update(next_works=nxt["works"], next_s=nxt["idle_s"],
             next_text=nxt["text"][-300:], processes_before=len(before),
             processes_gone=len(gone))
    c["survived"] = bool(nxt["works"]) and not gone
    shutil.rmtree(marker_dir, ignore_errors=True)
    # A new group for the next cycles (untimed), unless the recovery made one already
    # (nbdistributed's starts its workers again) or none is needed (the groups close next).
    if not c["survived"] and not last and (not gone or len(living) < len(before)):
        g.restart()
    return c


def measure_group_interrupt(groups, n: int, args) -> dict:
    variants, runs = GROUP_ROWS["interrupt"], {v: [] for v in GROUP_ROWS["interrupt"]}
    for i in range(args.group_interrupts):
        last = i == args.group_interrupts - 1
        for v in rotated(variants, i):
            runs[v].append(group_interrupt_cycle(groups, v, n, args, last))
    return {"runs": runs, "cap_s": args.interrupt_cap,
            "reply_s": {v: stats([x["reply_s"] for x in rs if x["reply_s"] is not None])
                        for v, rs in runs.items()},
            "survived": {v: sum(x["survived"] for x in rs) for v, rs in runs.items()}}


def measure_groups(args) -> dict:
    venv_bin = os.path.dirname(sys.executable)
    # nbdistributed starts its workers as `python` from PATH: this environment's, first.
    os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    res = {"per_n": []}
    for n in replica_counts(args.replicas):
        t0 = time.perf_counter()
        res["per_n"].append(measure_groups_once(n, args))
        print(f"peers: groups N={n} done [{time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    return res


def _st(st: Optional[dict], digits: int = 0, scale: float = 1.0) -> str:
    if st is None:
        return "—"
    return (f"{st['median'] * scale:.{digits}f} "
            f"({st['p10'] * scale:.{digits}f}–{st['p90'] * scale:.{digits}f})")


def render_groups(res: dict, info: dict, seconds: float, args) -> str:
    per = res["per_n"]
    head = "| peer | " + " | ".join(f"N={r['replicas']}" for r in per) + " |"
    rule = "|---|" + "---:|" * len(per)
    lab = ROW_LABEL
    L = ["## Peers: warm groups side by side (issue 35)", "",
         "Every peer that keeps N processes warm for cell after cell, each in a real "
         "ipykernel of its own (jupyter_client, as a front end), the four up at once and used "
         "in turns, order rotating: `%xla_session` (colab_xla; its text view "
         "`%%xla_spawn --no-widget` and its widget view `%%xla_spawn`), ipyparallel "
         f"{info.get('ipyparallel', '?')} (`%%px` on `ipp.Cluster(n=N)`), nbdistributed "
         f"{info.get('nbdistributed', '?')} (`%dist_init -n N`, then every plain cell runs on "
         "its workers) and jupyter-distributed "
         f"{info.get('jupyter-distributed', '?')} (the kernel its server extension swaps in, "
         "`python -m jupyter_distributed.kernel` with `JUPYTER_DISTRIBUTED_WORLD_SIZE=N`: "
         "every cell runs on its N rank kernels; seen as text, its display's text/plain, "
         "or as rank tabs, its live-update comm open as JupyterLab's renderer opens it). "
         "Median (p10–p90). nbdistributed is never stopped with its own `%dist_shutdown` / "
         "`%dist_reset` (they kill by name pattern machine-wide): its workers are killed by "
         "pid through its `ProcessManager`; every process a peer started is killed by pid "
         "at the end.", "",
         f"**Start**: s to a ready group of N ({args.group_starts} starts per peer). "
         "`%xla_session start`: the cell; ipyparallel: `ipp.Cluster(n=N)."
         "start_and_connect_sync()`; nbdistributed: `%dist_init` (which sleeps 2 s and "
         "returns before its workers connect: a cell sent then is lost and waits its 30 s "
         "timeout) and then until every worker answers; jupyter-distributed: its kernel's "
         "start until `kernel_info` replies (it starts the rank kernels first).", "",
         head, rule]
    for g in GROUPS:
        L.append(f"| {GROUP_LABEL[g]} | " + " | ".join(
            _st(r["stats"]["start_s"][g], 2) for r in per) + " |")
    L += ["", f"**Warm cell** `x = 1`: ms from `execute_request` to `idle` "
              f"({args.group_repeats} runs per peer after {WARM_ROUNDS} warm-up rounds). "
              f"The session's first {WARM_ROUNDS} widget-view cells in a kernel are the last "
              "row, not in the goals: a widget cell that prints makes its run's widgets "
              "there (a comm message each: 6, and 3 per replica), and later ones make a "
              "ended run's over (the kernel keeps one run's widgets); "
              "`x = 1`, which prints nothing and ends before its first draw, is shown as its "
              "summary alone and makes none.", "", head, rule]
    for v in GROUP_ROWS["warm"]:
        L.append(f"| {lab[v]} | " + " | ".join(
            _st(r["stats"]["warm_ms"][v], 1) for r in per) + " |")
    L.append(f"| {lab['xla_widget']}: the kernel's first {WARM_ROUNDS} widget cells | "
             + " | ".join(_st(r["stats"].get("first_widget_ms"), 1) for r in per) + " |")
    L += ["", f"**{args.group_lines:,} lines per replica** (`peer_jobs.printer`): s to `idle`; "
              "lines lost of those expected, summed over "
              f"{args.group_lines_repeats} runs, counted from what reached the notebook "
              "(`%%px`: the last update of each engine's output display; nbdistributed: its "
              "stream; jupyter-distributed: its display's last text/plain; the session: its "
              "full logs, whose path its views show beside the first 200 lines per replica). "
              "nbdistributed loses lines by a race in its display loop (read from its "
              "source): it prints the lines its receiving thread has appended, then marks "
              "as shown every line appended by then, so those appended while it printed are "
              "never shown.", "", head, rule]
    for v in GROUP_ROWS["lines"]:
        cells = []
        for r in per:
            x = r["lines"]
            bad = sum(not y["works"] for y in x["runs"][v])
            cells.append(f"{_st(x['wall_s'][v], 2)}; lost {x['lost'][v]:,} of "
                         f"{x['expected'][v]:,}" + (f"; {bad} run(s) failed" if bad else ""))
        L.append(f"| {lab[v]} | " + " | ".join(cells) + " |")
    L += ["", f"**A raise in one replica** (the last; the others return at once): s from "
              "`execute_request` to the first message showing the error; *raises*: the cell "
              "ends in error (Run All stops); *replica*, *line*: whether what is shown names "
              "the replica and the cell's line (`line 2`, or 3 counting the magic). "
              f"{args.group_raise_repeats} runs per peer.", "", head, rule]
    for v in GROUP_ROWS["raise"]:
        cells = []
        for r in per:
            rs = r["raise"]["runs"][v]
            raised = sum(x["status"] == "error" for x in rs)
            rep = sum(x["names_replica"] for x in rs)
            ln = sum(x["names_line"] for x in rs)
            cells.append(f"{_st(r['raise']['shown_s'][v], 3)}; raises {raised}/{len(rs)}, "
                         f"replica {rep}/{len(rs)}, line {ln}/{len(rs)}")
        L.append(f"| {lab[v]} | " + " | ".join(cells) + " |")
    L += ["", "**Interrupt to reply**: every replica in `peer_jobs.forever` (sleeps until "
              "stopped); once all have said so, Interrupt as Jupyter sends it "
              "(`KernelManager.interrupt_kernel`: SIGINT to the kernel's process group, which "
              "holds nbdistributed's workers too; for jupyter-distributed an `interrupt_request` "
              "message, the interrupt mode its server extension gives its kernel, which passes "
              "it on to every rank kernel); s to the cell's `execute_reply` (another "
              f"after {args.interrupt_cap:g} s, up to {args.max_interrupts}). "
              "*Survives*: the next cell (`x = 1` on the group) works within "
              f"{args.group_next_deadline:g} s and no process of the group is gone "
              f"({args.group_interrupts} cycles per peer; a group that did not survive is "
              "started again, untimed).", "", head, rule]
    for v in GROUP_ROWS["interrupt"]:
        cells = []
        for r in per:
            rs = r["interrupt"]["runs"][v]
            gone = max((x["processes_gone"] for x in rs), default=0)
            names = sorted({x["ename"] or str(x["status"]) for x in rs})
            cells.append(f"{_st(r['interrupt']['reply_s'][v], 3)}; survives "
                         f"{r['interrupt']['survived'][v]}/{len(rs)}"
                         + (f" ({gone} process(es) gone)" if gone else "")
                         + f"; ends {', '.join(names)}")
        L.append(f"| {lab[v]} | " + " | ".join(cells) + " |")
    L += ["", "**all_reduce without set-up**: the sum of `index + 1` over the replicas, with no "
              "set-up cell before (session: `xm.all_reduce` on `device`; nbdistributed: "
              "`dist.all_reduce`, its workers made a gloo group at start); ms to `idle`, and "
              f"runs with the right sum shown, of {args.group_repeats}.", "", head, rule]
    for v in GROUP_ROWS["allreduce"]:
        L.append(f"| {lab[v]} | " + " | ".join(
            f"{_st(r['allreduce']['stats_ms'][v], 1)}; right "
            f"{r['allreduce']['right'][v]}/{r['allreduce']['runs']}" for r in per) + " |")
    for g, why in CANNOT_ALLREDUCE.items():
        L.append(f"| {lab[g]} | " + " | ".join(why for _ in per) + " |")
    L += ["", "Goals (issue 35), at the median:"]
    others = ("px", "nbd", "jd")
    for v in ("xla", "xla_widget"):
        parts = []
        for r in per:
            w = r["stats"]["warm_ms"]
            best = min(w[o]["median"] for o in others)
            parts.append(f"N={r['replicas']}: {w[v]['median']:.1f} against {best:.1f} ms "
                         f"({'met' if w[v]['median'] <= best else 'not met'})")
        L.append(f"- {lab[v]}: warm cell at most the fastest other peer's: "
                 + "; ".join(parts) + ".")
    at8 = [r for r in per if r["replicas"] == 8]
    if at8:
        w = at8[0]["stats"]["warm_ms"]
        parts = [f"{lab[v]} {w[v]['median'] - w['plain']['median']:+.1f} ms "
                 f"({'met' if w[v]['median'] - w['plain']['median'] <= 2.0 else 'not met'})"
                 for v in ("xla", "xla_widget")]
        L.append("- warm cell within +2 ms of the plain cell at N=8: " + "; ".join(parts) + ".")
    for v in ("xla", "xla_widget"):
        parts = []
        for r in per:
            mine, theirs = (r["interrupt"]["reply_s"].get(p) for p in (v, "px"))
            if mine and theirs:
                ok = mine["median"] <= 2 * theirs["median"]
                parts.append(f"N={r['replicas']}: {mine['median'] * 1e3:.0f} against "
                             f"{theirs['median'] * 1e3:.0f} ms ({'met' if ok else 'not met'})")
        L.append(f"- {lab[v]}: Interrupt to reply within 2× of ipyparallel's: "
                 + "; ".join(parts) + ".")
    parts = []
    for r in per:
        text, widget = (r["lines"]["lost"][v] for v in ("xla", "xla_widget"))
        parts.append(f"N={r['replicas']}: {text:,} and {widget:,} "
                     f"({'met' if text + widget == 0 else 'not met'})")
    L.append("- no line lost, text and widget view: " + "; ".join(parts) + ".")
    parts = []
    for r in per:
        rs = r["raise"]["runs"]["xla"] + r["raise"]["runs"]["xla_widget"]
        good = all(x["names_replica"] and x["names_line"] and x["status"] == "error" for x in rs)
        parts.append(f"N={r['replicas']}: {'met' if good else 'not met'}")
    L.append("- a raise raises, naming the replica and the cell's line: " + "; ".join(parts)
             + ".")
    parts = []
    for r in per:
        s = sum(r["interrupt"]["survived"][v] for v in ("xla", "xla_widget"))
        t = sum(len(r["interrupt"]["runs"][v]) for v in ("xla", "xla_widget"))
        parts.append(f"N={r['replicas']}: {s}/{t} ({'met' if s == t else 'not met'})")
    L.append("- the session survives an interrupt: " + "; ".join(parts) + ".")
    L += ["", machine_line(
        info, GROUP_NAME, seconds,
        f"{args.group_starts} starts, {args.group_repeats} warm cells, "
        f"{args.group_lines_repeats} × {args.group_lines:,} lines, {args.group_raise_repeats} "
        f"raises, {args.group_interrupts} interrupts per peer and N",
        packages=", ".join(f"{d} {info.get(d, '?')}" for d in GROUP_DISTS))]
    return "\n".join(L)


# nbdistributed and jupyter-distributed: not in .venv (see bench/requirements-peers.txt).
PEERS_DIR = os.path.join(os.path.dirname(BENCH_DIR), "build", "peers")
GROUP_DISTS = ("ipyparallel", "nbdistributed", "jupyter-distributed", "ipykernel",
               "jupyter_client")


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
    # Section 6 (issue 35): the warm groups, at every --replicas count; its own results section.
    parser.add_argument("--group-starts", type=int, default=2,
                        help="starts of each group per N, timed (2)")
    parser.add_argument("--group-repeats", type=int, default=15,
                        help="warm cells and all_reduce cells per peer and N (15)")
    parser.add_argument("--group-lines", type=int, default=20_000,
                        help="lines per replica (20000)")
    parser.add_argument("--group-lines-repeats", type=int, default=2, help="(2)")
    parser.add_argument("--group-raise-repeats", type=int, default=3, help="(3)")
    parser.add_argument("--group-interrupts", type=int, default=3,
                        help="interrupt cycles per peer and N (3)")
    parser.add_argument("--group-next-deadline", type=float, default=10.0,
                        help="s the cell after an interrupt may take to count as working (10)")
    parser.add_argument("--no-groups", action="store_true",
                        help="leave section 6 (the warm groups, results section peer_groups) out")
    parser.add_argument("--only-groups", action="store_true",
                        help="section 6 alone: writes only its results section (peer_groups)")
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
    if args.only_groups:
        return publish_groups(args)
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
    publish(NAME, markdown, {"machine": info, "seconds": seconds, "args": vars(args), **res},
            out_dir=args.out)
    return 0 if args.no_groups else publish_groups(args)


# Four groups of N processes up at once (N=16: 64 Python processes, besides the kernels)
# is what this 24 GiB machine holds.
GROUP_MAX_REPLICAS = 16


def publish_groups(args) -> int:
    """Section 6: measured, then written as its own results section (``peer_groups``)."""
    if (args.group_starts < 1 or args.group_repeats < 1 or args.group_lines_repeats < 1
            or args.group_raise_repeats < 1 or args.group_interrupts < 1
            or not 1 <= max(replica_counts(args.replicas)) <= GROUP_MAX_REPLICAS):
        raise SystemExit("peers: section 6 needs every --group-* count >= 1 and replica "
                         f"counts 1..{GROUP_MAX_REPLICAS}")
    if not os.path.isdir(PEERS_DIR):
        raise SystemExit(f"peers: section 6 needs nbdistributed and jupyter-distributed in "
                         f"{PEERS_DIR}: run scripts/env (bench/requirements-peers.txt)")
    # Here and in every kernel this benchmark starts (their workers inherit it).
    sys.path.insert(0, PEERS_DIR)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (PEERS_DIR, os.environ.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    info = machine_info(args.group_repeats, 1)
    for dist in GROUP_DISTS:
        info[dist] = importlib.metadata.version(dist)
    res = measure_groups(args)
    seconds = time.perf_counter() - started
    return publish(GROUP_NAME, render_groups(res, info, seconds, args),
                   {"machine": info, "seconds": seconds, "args": vars(args), **res},
                   out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
