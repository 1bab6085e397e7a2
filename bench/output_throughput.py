"""Output throughput of ``%%xla_spawn`` against plain ``print`` from bare ``xmp.spawn``.

Every replica prints ``r{index} line {i}`` for i in range(LINES). Three paths, then the
views (below):

* core:   ``colab_xla.notebook.targets.run_cell(loop, replicas=R, announce=None)`` in this process
          (no IPython), after a warm-up run;
* magic:  ``%%xla_spawn -n R --no-widget`` of the same loop in a real ipykernel started
          with jupyter_client (the text view prints the first 200 lines of each replica
          live; all of them are in the log files named by ``full logs: DIR``);
* plain:  ``xmp.spawn(peer_jobs.printer, args=(LINES,), start_method='fork')`` in the
          same kernel: a forked child's ``print`` goes through ipykernel's OutStream,
          which sends each flush from the child over a fresh zmq connection, and the
          replicas (threads of one process on CPU) share its buffer.

The views: the same loop timed by each replica itself, under the text view
(``--no-widget``) and the widget view (the default), interleaved, one-off and on a session
of the same kernel, then the same on a local Ray cluster of 2 hosts (``%xla_cluster local``,
the replicas split between them): the cell's wall time and the slowest replica's own
printing time (a view that reads slowly blocks the replicas on full pipes: issue 31's 39x).

Completeness is counted line by line, for the core and magic paths from each replica's
log file, for the plain path from every IOPub ``stream`` message of the execution: a
line is *mixed* if it does not match ``^r(\\d+) line (\\d+)$`` (or is in another
replica's log), *out of order* if it comes after a later line of its replica, and *lost*
lines are those never seen intact. Wall time: the call for core; for the kernel paths
from ``execute_request`` to the kernel's ``idle`` status. RSS: of the notebook's process
(this one for core, the kernel for the others), before/after and peak (sampled at 20 Hz).

The plain path is slow (a zmq connection per flush): it runs ``--plain-lines`` lines per
replica (default 5,000; the table says so), and the magic path runs that size too, for a
like-for-like row, besides the full ``--lines``.

Where the time went (py-spy, ``run_cell`` of 8 x 100,000 lines, 2 cores, before the output
ring): in the replicas, a ``write(2)`` per line on the frame pipe (~35% of a replica's time)
and ``os.getpid()`` per frame (a system call too, ~20%), then the stream layer's thread-local
look-ups (a missed ``getattr`` raises inside); in the notebook, decoding frame by frame
(``FrameDecoder.feed``, then a second pass to join a replica's lines), and, every tick,
``psutil`` reading all of /proc once per replica process to find their children. Now: frames
go to a shared-memory ring per replica process (``colab_xla.wire.ring``), no system call
per line; the decoder joins a replica's consecutive lines as it goes; /proc is read once a tick.

Writes the "output_throughput" section of results.md and results/output_throughput.json.

    python bench/output_throughput.py [--lines 100000] [--replicas 8] [--plain-lines 5000]
        [--view-repeats 2] [--targets one-off,session,cluster,cluster-session]
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, Iterable, List, Optional

import psutil

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (bench_parser, machine_info, machine_line, publish,  # noqa: E402
                      replica_counts)

NAME = "output_throughput"
LINE = re.compile(r"^r(\d+) line (\d+)$")
LOOP = "for i in range({n}):\n    print(f'r{{index}} line {{i}}')"


# --- counting -----------------------------------------------------------------------------


def tally(lines: Iterable[str], replicas: int, n: int, owner: Optional[int] = None,
          counts: Optional[dict] = None) -> dict:
    """Count lines of ``r{index} line {i}`` (``owner``: the only replica expected)."""
    c = counts if counts is not None else {
        "seen": [set() for _ in range(replicas)], "last": [-1] * replicas,
        "mixed": 0, "out_of_order": 0, "duplicates": 0, "mixed_examples": []}
    for line in lines:
        m = LINE.match(line)
        r, i = (int(m.group(1)), int(m.group(2))) if m else (None, None)
        if m is None or r >= replicas or i >= n or (owner is not None and r != owner):
            c["mixed"] += 1
            if len(c["mixed_examples"]) < 5:
                c["mixed_examples"].append(line[:120])
            continue
        if i in c["seen"][r]:
            c["duplicates"] += 1
            continue
        if i < c["last"][r]:
            c["out_of_order"] += 1
        c["seen"][r].add(i)
        c["last"][r] = max(c["last"][r], i)
    return c


def summarize(c: dict, replicas: int, n: int) -> dict:
    complete = sum(len(s) for s in c["seen"])
    return {"expected": replicas * n, "complete": complete, "lost": replicas * n - complete,
            "out_of_order": c["out_of_order"], "mixed": c["mixed"],
            "duplicates": c["duplicates"], "mixed_examples": c["mixed_examples"],
            "lost_per_replica": [n - len(s) for s in c["seen"]]}


def check_logs(log_dir: str, replicas: int, n: int) -> dict:
    """Count every replica's log file (replica-N.log) against what it printed."""
    c = None
    for o in range(replicas):
        path = os.path.join(log_dir, f"replica-{o}.log")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            lines = []
        if lines and lines[-1] == "":
            lines.pop()
        c = tally(lines, replicas, n, owner=o, counts=c)
    return summarize(c, replicas, n)


class RssSampler:
    """Peak RSS of a process, sampled in a thread while a path runs."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.proc, self.interval = psutil.Process(pid), interval
        self._stop = threading.Event()
        self.before = self.peak = self.after = self.proc.memory_info().rss

    def __enter__(self):
        self.before = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.after = self.proc.memory_info().rss
        self.peak = max(self.peak, self.after)

    def result(self) -> dict:
        mb = 1 << 20
        return {"rss_before_mb": self.before / mb, "rss_after_mb": self.after / mb,
                "rss_peak_mb": self.peak / mb, "rss_growth_mb": (self.after - self.before) / mb,
                "rss_peak_growth_mb": (self.peak - self.before) / mb}


# --- core: run_cell in this process -------------------------------------------------------


def measure_core(replicas: int, n: int, warmup_lines: int) -> dict:
    from colab_xla.notebook.targets import run_cell

    run_cell(LOOP.format(n=warmup_lines), replicas=replicas, announce=None)
    with RssSampler(os.getpid()) as rss:
        t0 = time.perf_counter()
        outcome = run_cell(LOOP.format(n=n), replicas=replicas, announce=None)
        wall = time.perf_counter() - t0
    if outcome.failed:
        raise RuntimeError(f"run_cell failed: {[r.error for r in outcome.replicas.values()]}")
    counts = check_logs(outcome.log_dir, replicas, n)
    counts["lines_total"] = [outcome.replicas[o].log.lines_total for o in range(replicas)]
    shutil.rmtree(outcome.log_dir, ignore_errors=True)  # ~15 bytes a line; checked now
    return {"path": "core", "replicas": replicas, "lines": n, "wall_s": wall,
            "lines_per_s": replicas * n / wall, **counts, **rss.result()}


# --- the kernel paths ---------------------------------------------------------------------


class Kernel:
    """A real ipykernel (jupyter_client), and executions with every IOPub message kept."""

    def __init__(self, replicas: int):
        from jupyter_client import KernelManager

        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(replicas))
        # Over IPC, its sockets and connection file in a private directory (as
        # tools/run_notebooks.py starts kernels): ipykernel 7 warns at every start over TCP.
        # Absolute paths: the kernel starts in BENCH_DIR, jupyter_client's default is relative.
        self.ipc_dir = tempfile.mkdtemp(prefix="colab_xla-bench-kernel-")
        self.km = KernelManager(kernel_name="python3", transport="ipc",
                                ip=os.path.join(self.ipc_dir, "kernel"),
                                connection_file=os.path.join(self.ipc_dir, "kernel.json"))
        self.km.start_kernel(env=env, cwd=BENCH_DIR)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.pid = int(self.value("import os; os.getpid()"))
        self.executable = self.value("import sys; sys.executable").strip("'")

    def value(self, code: str) -> str:
        r = self.execute(code, deadline=120)
        if r["status"] != "ok" or r["result"] is None:
            raise RuntimeError(f"kernel: {code!r} -> {r['status']}: {r['stderr'][-2000:]}"
                               f"{r['error']}")
        return r["result"]

    def execute(self, code: str, deadline: float, grace: float = 1.0,
                on_message: Optional[Callable[[dict, float], None]] = None) -> dict:
        """Run ``code``; collect its stream messages until reply and idle (or deadline),
        then for ``grace`` s more (late output of forked children). ``on_message(msg,
        arrived)`` sees every IOPub message of the execution, with the ``time.time()`` it
        was received here."""
        kc = self.kc
        t0 = time.perf_counter()
        msg_id = kc.execute(code)
        out: List[str] = []
        err: List[str] = []
        r = {"status": None, "result": None, "error": None, "reply_s": None, "idle_s": None,
             "last_stream_s": None, "stream_messages": 0, "stream_messages_after_idle": 0,
             "timed_out": False}
        stop_at = t0 + deadline
        while True:
            if r["reply_s"] is None:
                try:
                    reply = kc.get_shell_msg(timeout=0)
                except queue.Empty:
                    pass
                else:
                    if reply["parent_header"].get("msg_id") == msg_id:
                        r["reply_s"] = time.perf_counter() - t0
                        r["status"] = reply["content"]["status"]
                        if r["status"] == "error":
                            r["error"] = (f"{reply['content'].get('ename')}: "
                                          f"{reply['content'].get('evalue')}")
            now = time.perf_counter()
            done = r["reply_s"] is not None and r["idle_s"] is not None
            if done and now >= t0 + r["idle_s"] + grace:
                break
            if not done and now >= stop_at:
                r["timed_out"] = True
                break
            wait = 0.05 if not done else min(0.05, t0 + r["idle_s"] + grace - now)
            try:
                msg = kc.get_iopub_msg(timeout=wait)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if on_message is not None:
                on_message(msg, time.time())
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
                r["stream_messages"] += 1
                r["last_stream_s"] = time.perf_counter() - t0
                if r["idle_s"] is not None:
                    r["stream_messages_after_idle"] += 1
            elif kind == "execute_result":
                r["result"] = content["data"].get("text/plain")
            elif kind == "status" and content["execution_state"] == "idle":
                r["idle_s"] = time.perf_counter() - t0
        r["stdout"], r["stderr"] = "".join(out), "".join(err)
        return r

    def recover(self) -> None:
        """After a deadline: interrupt; if the kernel stays busy, restart it."""
        self.km.interrupt_kernel()
        if self.execute("1", deadline=30)["status"] != "ok":
            self.km.restart_kernel(now=True)
            self.kc.wait_for_ready(timeout=120)
            self.pid = int(self.value("import os; os.getpid()"))

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            try:
                self.km.shutdown_kernel(now=True)
            finally:
                shutil.rmtree(self.ipc_dir, ignore_errors=True)


SETUP = f"""\
import sys
sys.path.insert(0, {BENCH_DIR!r})
import peer_jobs
import torch_xla.distributed.xla_multiprocessing as xmp
get_ipython().run_line_magic("load_ext", "colab_xla")
"""


def split_lines(text: str) -> List[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def run_plain(k: Kernel, replicas: int, n: int, deadline: float) -> dict:
    code = f"xmp.spawn(peer_jobs.printer, args=({n},), start_method='fork')"
    return run_streamed(k, code, "plain", replicas, n, deadline)


def run_streamed(k: Kernel, code: str, path: str, replicas: int, n: int, deadline: float,
                 banner: Optional[str] = None) -> dict:
    """Run ``code`` whose replicas print straight to the kernel's stdout; count the lines
    of every IOPub ``stream`` message (``banner``: a line the launcher itself prints,
    not counted)."""
    with RssSampler(k.pid) as rss:
        r = k.execute(code, deadline=deadline, grace=2.0)
    if r["timed_out"]:
        k.recover()
    lines = [line for line in split_lines(r["stdout"]) if banner is None or line != banner]
    counts = summarize(tally(lines, replicas, n), replicas, n)
    wall = r["idle_s"] if r["idle_s"] is not None else deadline
    return {"path": path, "replicas": replicas, "lines": n, "wall_s": wall,
            "lines_per_s": replicas * n / wall, **counts, **rss.result(),
            "stderr_tail": r["stderr"][-500:], **_meta(r)}


def run_magic(k: Kernel, replicas: int, n: int, deadline: float,
              body: Optional[str] = None) -> dict:
    """``%%xla_spawn --no-widget`` of ``body`` (default: the print loop of ``n`` lines),
    counted from the full logs."""
    code = f"%%xla_spawn -n {replicas} --no-widget\n" + (body or LOOP.format(n=n))
    with RssSampler(k.pid) as rss:
        r = k.execute(code, deadline=deadline)
    if r["timed_out"]:
        k.recover()
    found = re.findall(r"^full logs: (.+)$", r["stdout"], re.MULTILINE)
    if r["status"] != "ok" or not found:
        raise RuntimeError(f"%%xla_spawn: status {r['status']} {r['error']}; output tail:\n"
                           f"{r['stdout'][-2000:]}{r['stderr'][-2000:]}")
    log_dir = found[-1].strip()
    counts = check_logs(log_dir, replicas, n)
    shutil.rmtree(log_dir, ignore_errors=True)
    # The live view: the first LIVE_LINES of each replica, labelled, in order.
    live = [m.group(1) for m in re.finditer(r"^\[replica \d+\] (r\d+ line \d+)$",
                                            r["stdout"], re.MULTILINE)]
    live_counts = summarize(tally(live, replicas, n), replicas, n)
    headline_ok = f"{replicas} replicas on CPU: {replicas} done" in r["stdout"]
    wall = r["idle_s"] if r["idle_s"] is not None else deadline
    return {"path": "magic", "replicas": replicas, "lines": n, "wall_s": wall,
            "lines_per_s": replicas * n / wall, **counts, **rss.result(),
            "live_lines_shown": live_counts["complete"],
            "live_out_of_order": live_counts["out_of_order"],
            "live_mixed": live_counts["mixed"], "headline_ok": headline_ok, **_meta(r)}


# The print loop, timed by each replica itself: its value is how long its own printing took.
OWN_TIMED = "import time as _time\n_t = _time.perf_counter()\n{loop}\n_time.perf_counter() - _t"
VIEWS = ("text", "widget")


def run_view(k: Kernel, replicas: int, n: int, view: str, targeted: bool,
             deadline: float) -> dict:
    """The timed print loop under ``view`` ("text": --no-widget; "widget": the default),
    on the kernel's target (``targeted``: its session or cluster; else a one-off run of
    ``replicas``): the cell's wall time, and the slowest replica's own printing time (a
    view that reads slowly blocks replicas on full pipes)."""
    flags = ("" if targeted else f"-n {replicas} ") + ("--no-widget " if view == "text" else "")
    code = f"%%xla_spawn {flags}-o _own\n" + OWN_TIMED.format(loop=LOOP.format(n=n))
    r = k.execute(code, deadline=deadline)
    if r["timed_out"] or r["status"] != "ok":
        if r["timed_out"]:
            k.recover()
        raise RuntimeError(f"{view} view: {r['status']} {r['error']} (timed out: "
                           f"{r['timed_out']}); {r['stderr'][-1000:]}")
    own = float(k.value("max(_own.values())"))
    return {"wall_s": r["idle_s"], "own_s": own}


# The targets the views are measured on: a one-off run and a session of this kernel's
# replicas, and the same on a local Ray cluster of CLUSTER_HOSTS hosts (the replicas split
# between them; their output comes through each host's agent).
TARGETS = ("one-off", "session", "cluster", "cluster session")
CLUSTER_HOSTS = 2


def _up(k: Kernel, code: str, what: str) -> None:
    r = k.execute(code, deadline=300)
    if r["status"] != "ok":
        raise RuntimeError(f"{what}: {r['error']} {r['stdout'][-2000:]}{r['stderr'][-2000:]}")


def measure_views(k: Kernel, replicas: int, n: int, repeats: int, deadline: float,
                  targets=TARGETS) -> dict:
    """Each view on each target, interleaved ``repeats`` times: medians. The local cluster
    is started once, for its targets (one-off and session) both."""
    found = {}
    per_host = max(1, replicas // CLUSTER_HOSTS)
    for on_cluster in (False, True):
        mine = [t for t in targets if t.startswith("cluster") == on_cluster]
        if not mine:
            continue
        if on_cluster:
            _up(k, f"%xla_cluster local --hosts {CLUSTER_HOSTS} -n {per_host}", "cluster start")
        try:
            for target in mine:
                found.update(_measure_target(k, target, replicas, n, repeats, deadline))
        finally:
            if on_cluster:
                k.execute("%xla_cluster stop", deadline=120)
    views = {"replicas": replicas, "lines": n, "repeats": repeats, "runs": found}
    if any(t.startswith("cluster") for t in targets):
        views["cluster"] = f"{CLUSTER_HOSTS} hosts × {per_host} replicas"
    return views


def _measure_target(k: Kernel, target: str, replicas: int, n: int, repeats: int,
                    deadline: float) -> dict:
    """Both views on ``target`` (its cluster, if any, up already)."""
    on_cluster, session = target.startswith("cluster"), target.endswith("session")
    if session:
        _up(k, "%xla_session start" + ("" if on_cluster else f" -n {replicas}"),
            "session start")
    try:
        for view in VIEWS:  # warm-ups: a cluster's first cell starts its hosts' pools
            run_view(k, replicas, min(n, 1000), view, session or on_cluster, deadline)
        runs = {view: [] for view in VIEWS}
        for _ in range(repeats):
            for view in VIEWS:
                runs[view].append(run_view(k, replicas, n, view, session or on_cluster,
                                           deadline))
    finally:
        if session:
            k.execute("%xla_session stop", deadline=60)
    return {f"{target} {view}": {
        "wall_s": statistics.median(r["wall_s"] for r in done),
        "own_s": statistics.median(r["own_s"] for r in done),
        "walls": [r["wall_s"] for r in done], "owns": [r["own_s"] for r in done]}
        for view, done in runs.items()}


def render_views(views: dict) -> List[str]:
    runs = views["runs"]
    rows = []
    for target in (t for t in TARGETS if f"{t} text" in runs):
        text, widget = runs[f"{target} text"], runs[f"{target} widget"]
        for view, r in (("text (`--no-widget`)", text), ("widget (the default)", widget)):
            rows.append(f"| {target} | {view} | {r['wall_s']:.2f} | {r['own_s']:.2f} |")
        rows.append(f"| {target} | **widget ÷ text** "
                    f"| **{widget['wall_s'] / text['wall_s']:.2f}×** "
                    f"| **{widget['own_s'] / text['own_s']:.2f}×** |")
    cluster = (f" The cluster is a local Ray cluster of {views['cluster']} (`%xla_cluster "
               "local`): output comes through each host's agent." if "cluster" in views else "")
    return [
        "### The views under heavy output",
        "",
        f"{views['replicas']} replicas × {views['lines']:,} lines, in the same kernel, text and "
        f"widget views interleaved ({views['repeats']} runs each, medians): the cell's wall "
        "time (`execute_request` to `idle`) and the slowest replica's own printing time (its "
        "value: a view that reads slowly blocks replicas on full pipes). Goal (issue 31): "
        "widget within 1.2× of text for the cell, 1.1× for the replicas." + cluster,
        "",
        "| target | view | cell s | replicas' own printing s |",
        "|---|---|---:|---:|",
        *rows,
        "",
    ]


def _meta(r: dict) -> dict:
    keys = ("status", "error", "reply_s", "idle_s", "last_stream_s", "stream_messages",
            "stream_messages_after_idle", "timed_out")
    return {"kernel_" + k: r[k] for k in keys}


def measure_kernel(replicas: int, n: int, plain_n: int, warmup_lines: int,
                   deadline: float, view_repeats: int, targets=TARGETS) -> dict:
    k = Kernel(replicas)
    try:
        setup = k.execute(SETUP, deadline=180)
        if setup["status"] != "ok":
            raise RuntimeError(f"kernel setup: {setup['error']}\n{setup['stderr'][-2000:]}")
        run_plain(k, replicas, 10, deadline=60)  # warm-ups: fork, the lock-free paths
        run_magic(k, replicas, warmup_lines, deadline=120)
        plain = run_plain(k, replicas, plain_n, deadline)
        magic_same = run_magic(k, replicas, plain_n, deadline)
        magic_full = run_magic(k, replicas, n, deadline) if n != plain_n else magic_same
        views = measure_views(k, replicas, n, view_repeats, deadline, targets)
        return {"kernel_python": k.executable, "plain": plain, "magic_same": magic_same,
                "magic_full": magic_full, "views": views}
    finally:
        k.shutdown()


# --- report -----------------------------------------------------------------------------


def _row(label: str, where: str, r: dict, note: str = "") -> str:
    return (f"| {label} | {where} | {r['replicas']} × {r['lines']:,}{note} | {r['wall_s']:.2f} "
            f"| {r['lines_per_s']:,.0f} | {r['complete']:,} | {r['lost']:,} "
            f"| {r['out_of_order']:,} | {r['mixed']:,} | {r['rss_growth_mb']:+.1f} "
            f"({r['rss_peak_growth_mb']:+.1f}) |")


def render(res: dict, info: dict, seconds: float) -> str:
    core, k = res["core"], res["kernel"]
    plain, same, full = k["plain"], k["magic_same"], k["magic_full"]
    small = " ¹" if plain["lines"] != full["lines"] else ""
    rows = [_row("`run_cell` (core)", "this process", core),
            _row("`%%xla_spawn --no-widget`", "ipykernel", full)]
    if same is not full:
        rows.append(_row("`%%xla_spawn --no-widget`", "ipykernel", same, small))
    rows.append(_row("plain `print`, bare `xmp.spawn`", "ipykernel", plain, small))
    ratio = same["lines_per_s"] / plain["lines_per_s"]
    lines = [
        "## Output throughput",
        "",
        "Every replica prints `r{index} line {i}` for i < LINES. Lines are counted from each "
        "replica's full log file (`%%xla_spawn`, `run_cell`) or from every IOPub `stream` "
        "message of the execution (plain `print` from `xmp.spawn(printer, "
        "start_method='fork')` children, which goes through ipykernel's OutStream). "
        "*mixed*: not exactly `r<k> line <i>` (or in another replica's log); *out of "
        "order*: after a later line of its replica; *lost*: never seen intact. Wall: the "
        "call (core), or `execute_request` to `idle` (kernel). RSS: the notebook's "
        "process (the kernel for kernel rows), growth after − before (peak).",
        "",
        "| path | notebook | replicas × lines | wall s | lines/s | complete | lost "
        "| out of order | mixed | RSS MB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]
    if small:
        est = full["lines"] * plain["replicas"] / plain["lines_per_s"]
        est_text = f"{est / 60:.0f} min" if est >= 120 else f"{est:.0f} s"
        lines.append(
            f"¹ Plain `print` runs {plain['lines']:,} lines per replica, not "
            f"{full['lines']:,}: at its {plain['lines_per_s']:,.0f} lines/s (one zmq "
            f"connection per flush from a forked child), {full['lines']:,} would take "
            f"≈{est_text}. `%%xla_spawn` of the same size is the like-for-like row.")
        lines.append("")
    lines += [
        f"Same size, same kernel: `%%xla_spawn` {ratio:,.1f}× the plain path's lines/s, with "
        f"{same['lost']:,} lost / {same['mixed']:,} mixed / {same['out_of_order']:,} out of "
        f"order against {plain['lost']:,} / {plain['mixed']:,} / {plain['out_of_order']:,}. "
        f"The text view showed the first {full['live_lines_shown'] // max(1, full['replicas']):,} "
        f"lines of each replica live ({full['live_out_of_order']} out of order, "
        f"{full['live_mixed']} mixed); the rest only in the log files.",
        "",
        f"Plain path: {plain['kernel_stream_messages']:,} `stream` messages arrived "
        f"({plain['kernel_stream_messages_after_idle']} after `idle`; "
        f"{'timed out' if plain['kernel_timed_out'] else 'no time-out'}), "
        f"{plain['kernel_stream_messages'] / plain['expected']:.1f} per printed line (a "
        "`print` writes the text, then the newline, each sent on its own), from "
        f"{plain['replicas']} replica threads of one process sharing one OutStream: lines "
        "are lost by being glued to other replicas' text (e.g. "
        f"`{(plain['mixed_examples'] or [''])[0][:60]}`), leaving empty lines where their "
        "newlines land.",
        "",
        *render_views(k["views"]),
        machine_line(info, NAME, seconds,
                     "noisy; one timed run per row after warm-ups, kernel with PJRT_DEVICE=CPU "
                     f"CPU_NUM_DEVICES={full['replicas']}",
                     packages=f"ipykernel {info['ipykernel']}"),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--lines", type=int, default=100_000,
                        help="lines per replica, core and %%%%xla_spawn (100000)")
    parser.add_argument("--plain-lines", type=int, default=5_000,
                        help="lines per replica for plain print (5000; 0: --lines)")
    parser.add_argument("--replicas", default="8",
                        help="replicas (8; of a list such as bench/run passes, the largest)")
    parser.add_argument("--warmup-lines", type=int, default=1000,
                        help="lines per replica of the warm-up runs (1000)")
    parser.add_argument("--view-repeats", type=int, default=2,
                        help="runs of each view, one-off and session, interleaved (2)")
    choices = {t.replace(" ", "-"): t for t in TARGETS}  # (their names on the command line)
    parser.add_argument("--targets", default=",".join(choices),
                        help=f"the views' targets, comma-separated ({','.join(choices)})")
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="seconds a kernel execution may take before it is "
                             "interrupted and counted as wedged (300)")
    args, _ = parser.parse_known_args(argv)  # bench/run passes every benchmark's options
    replicas = max(replica_counts(args.replicas))
    plain_lines = args.plain_lines or args.lines
    if replicas < 1 or args.lines < 1 or plain_lines < 1 or replicas > 10:
        parser.error("need 1 <= replicas <= 10 (one-digit ordinals) and lines >= 1")
    asked = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not asked or set(asked) - set(choices) or args.view_repeats < 1:
        parser.error(f"need --targets of {', '.join(choices)} (not {args.targets!r}) and "
                     "--view-repeats >= 1")
    targets = [choices[t] for t in asked]

    import importlib.metadata

    started = time.perf_counter()
    info = machine_info(1, 1)
    info["ipykernel"] = importlib.metadata.version("ipykernel")
    t0 = time.perf_counter()
    core = measure_core(replicas, args.lines, args.warmup_lines)
    print(f"output_throughput: core {core['lines_per_s']:,.0f} lines/s, lost {core['lost']} "
          f"[{time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    t0 = time.perf_counter()
    kernel = measure_kernel(replicas, args.lines, plain_lines, args.warmup_lines,
                            args.deadline, args.view_repeats, targets)
    for key in ("plain", "magic_same", "magic_full"):
        r = kernel[key]
        print(f"output_throughput: {key} {r['lines']} lines: {r['wall_s']:.1f} s, "
              f"{r['lines_per_s']:,.0f} lines/s, lost {r['lost']}, mixed {r['mixed']}, "
              f"out of order {r['out_of_order']}", file=sys.stderr)
    for key, r in kernel["views"]["runs"].items():
        print(f"output_throughput: {key} view: cell {r['wall_s']:.2f} s, replicas' own "
              f"{r['own_s']:.2f} s", file=sys.stderr)
    print(f"output_throughput: kernel paths [{time.perf_counter() - t0:.0f} s]",
          file=sys.stderr)
    seconds = time.perf_counter() - started
    res = {"core": core, "kernel": kernel}
    markdown = render(res, info, seconds)
    return publish(NAME, markdown, {"machine": info, "seconds": seconds,
                                          "plain_lines": plain_lines, **res},
                         out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
