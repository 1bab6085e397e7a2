"""What every benchmark shares: the results file (each owns a section of results.md), the
machine description, summary statistics and the command-line basics.

``write_section(name, markdown, raw)`` replaces only the text between
``<!-- section:NAME -->`` and ``<!-- /section:NAME -->`` in ``results.md`` (appending the
section if it is new) and writes ``raw`` to ``results/NAME.json``, so benchmarks run one
at a time never clobber each other's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
_TITLE = ("# Benchmark results\n\n"
          "Written by `bench/run`; each section is replaced only by its own benchmark. "
          "See [README.md](README.md).\n")


def write_section(name: str, markdown: str, raw: Any, out_dir: str = BENCH_DIR) -> str:
    """Put ``markdown`` in section ``name`` of ``out_dir/results.md``; return its path."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"section name {name!r}: letters, digits, '_', '.', '-' only")
    os.makedirs(os.path.join(out_dir, "results"), exist_ok=True)
    _write(os.path.join(out_dir, "results", f"{name}.json"),
           json.dumps(raw, indent=2, sort_keys=True) + "\n")

    path = os.path.join(out_dir, "results.md")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = _TITLE
    begin, end = f"<!-- section:{name} -->", f"<!-- /section:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    _write(path, text)
    return path


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)  # a reader never sees half a file


def publish(name: str, markdown: str, raw: Any, out_dir: str = BENCH_DIR) -> int:
    """A benchmark's last step: write its section and raw figures, show the section."""
    path = write_section(name, markdown, raw, out_dir=out_dir)
    print(markdown)
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


def machine_line(info: dict, name: str, seconds: float, how: str, packages: str = "") -> str:
    """The closing line of a section: machine, versions, date, how it ran, commit, raw file."""
    dirty = " (colab_xla/ modified)" if info["colab_xla_dirty"] else ""
    return (f"Machine: {info['cores']} cores ({info['cores_usable']} usable), CPU only; "
            f"Python {info['python']}, torch {info['torch']}, torch_xla {info['torch_xla']}"
            f"{', ' + packages if packages else ''}; {info['date']}; {how}; commit "
            f"{info['git_commit'] or '?'}{dirty}; benchmark took {seconds:.0f} s. "
            f"Raw figures: [results/{name}.json](results/{name}.json).")


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph, and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", default=BENCH_DIR,
                        help="directory for results.md and results/ (bench/)")
    return parser


def replica_counts(text: str) -> List[int]:
    """``"1,4,8"`` -> ``[1, 4, 8]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def rotated(paths, i: int):
    """``paths`` starting at the ``i``-th (cyclically): the order of iteration ``i``, so
    drift and position effects hit every path alike (A B C, B C A, C A B, ...)."""
    k = i % len(paths)
    return tuple(paths[k:]) + tuple(paths[:k])


def median_range(values: List[Optional[float]]) -> str:
    """``"median (min–max)"`` of the values given (None: not measured), ms, whole."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.0f}"
    return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})"


def paired(samples: List[float], floor: List[float]) -> Dict[str, float]:
    """:func:`stats` of the paired differences, each iteration's sample minus that
    iteration's ``floor`` sample (robust to drift across iterations)."""
    return stats([a - b for a, b in zip(samples, floor)])


def stats(ms: List[float]) -> Optional[Dict[str, float]]:
    """Median, p10/p90, min, max; None for no samples (one sample: all the same)."""
    if not ms:
        return None
    if len(ms) == 1:
        return dict.fromkeys(("median", "p10", "p90", "min", "max"), ms[0])
    deciles = statistics.quantiles(ms, n=10, method="inclusive")
    return {"median": statistics.median(ms), "p10": deciles[0], "p90": deciles[-1],
            "min": min(ms), "max": max(ms)}


def schedstat_ms(pids: List[int]) -> Tuple[float, float]:
    """``(on a CPU, waiting for one)``, ms, summed over every thread of ``pids`` (each
    thread's ``/proc/PID/task/TID/schedstat``: nanoseconds, where ``cpu_times``' clock ticks
    are too coarse for a cell of a few ms). A thread or process that is gone counts
    nothing: one that ends between two reads drops out of the second."""
    run = wait = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError), \
                        open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    on_cpu, waiting, _ = f.read().split()
                    run, wait = run + int(on_cpu), wait + int(waiting)
    return run / 1e6, wait / 1e6


class Memcpy:
    """The one reference every result-return figure is a share of: what a copy of the same
    bytes costs in the notebook's process, the faster of two ways.

    ``count`` float32 tensors of ``nbytes`` each (the replicas' results), copied into
    destinations written before (warm: their pages exist and are this process's own, so the
    copy allocates and faults nothing), either by ``dst.copy_(src)`` (torch's threads share
    out each tensor) or by as many threads as torch uses, each copying whole tensors with
    ``memmove`` (as the replicas each copy their own). Neither is always the faster (one
    2-core machine ran ``copy_`` at ~13 GB/s and a tensor per thread at ~20):
    :meth:`seconds` times both, one after the other, and gives the shorter time
    (:attr:`ways`: each one's). Make it, and call it, in the notebook's process (in
    ``bench/peers.py``, the kernel, once before the cells it is compared with; in
    ``bench/result_return.py``, interleaved with them) in the same run. ``src`` are the
    tensors it copies.
    """

    def __init__(self, nbytes: int, count: int):
        import torch

        self.nbytes, self.count = nbytes, count
        self.threads = max(1, min(count, torch.get_num_threads()))
        self.src = [torch.full((nbytes // 4,), float(i)) for i in range(count)]
        self._dst = [torch.zeros_like(s) for s in self.src]  # written: warm
        self.ways: Dict[str, float] = {}  # the last call's time of each way
        self.seconds()  # first copies untimed

    def seconds(self) -> float:
        self.ways = {"copy_": self._timed(self._torch_copy),
                     "memmove per tensor": self._timed(self._threads_copy)}
        return fastest(self.ways)

    def _timed(self, copy) -> float:
        # Untimed: every destination page written again first. A fork since the last copy
        # (the replicas of a run timed in between) left them write-protected, and the copy
        # would time copy-on-write faults (0.6 GB/s with a child alive, 8 once it is gone).
        for dst in self._dst:
            dst.zero_()
        return copy()

    def _torch_copy(self) -> float:
        started = time.perf_counter()
        for dst, src in zip(self._dst, self.src):
            dst.copy_(src)
        return time.perf_counter() - started

    def _threads_copy(self) -> float:
        # Threads of this call only, ended before it returns: a thread left running in the
        # kernel would be a foreign thread to the next %%xla_spawn's fork.
        pairs = list(zip(self._dst, self.src))
        start = threading.Barrier(self.threads + 1)

        def copy(share) -> None:
            start.wait()
            for dst, src in share:  # memmove lets go of the GIL
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), self.nbytes)

        workers = [threading.Thread(target=copy, args=(pairs[k::self.threads],))
                   for k in range(self.threads)]
        for worker in workers:
            worker.start()
        start.wait()
        started = time.perf_counter()
        for worker in workers:
            worker.join()
        return time.perf_counter() - started


def memcpy_ways(nbytes: int, count: int, repeats: int) -> List[Dict[str, float]]:
    """:class:`Memcpy`: ``repeats`` timed copies of ``count`` x ``nbytes`` (then freed), each
    the seconds of both ways (:attr:`Memcpy.ways`); the reference is the faster
    (:func:`fastest`)."""
    reference = Memcpy(nbytes, count)
    samples = []
    for _ in range(repeats):
        reference.seconds()
        samples.append(reference.ways)
    return samples


def fastest(ways: Dict[str, float]) -> float:
    """The reference's seconds in one sample of :func:`memcpy_ways`."""
    return min(ways.values())


def ways_prose(samples: List[Dict[str, float]], nbytes: int) -> str:
    """Each way's GB/s (median over ``samples`` of :func:`memcpy_ways`, ``nbytes`` in all)."""
    return ", ".join(f"`{way}` {nbytes / statistics.median(s[way] for s in samples) / 1e9:.1f}"
                     for way in samples[0]) + " GB/s"


MEMCPY_PROSE = ("memcpy (the reference): a copy of the same tensors in the notebook's "
                "process, into destinations written before (warm), the faster of "
                "`dst.copy_(src)` (torch's threads share out each tensor) and a whole tensor "
                "per thread by `memmove`, as many threads as torch uses (`bench/_results.py` "
                "`Memcpy`), measured in the same run")


def machine_info(repeats: int, warmups: int) -> dict:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "missing"

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cores": os.cpu_count(), "cores_usable": affinity,
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": version("torch"), "torch_xla": version("torch_xla"),
        "ipython": version("ipython"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "repeats": repeats, "warmups": warmups,
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "colab_xla_dirty": bool(git("status", "--porcelain", "--", "colab_xla")),
        # What %%xla_spawn sees; unset means it scans the PCI bus for TPUs every run.
        "notebook_PJRT_DEVICE": os.environ.get("PJRT_DEVICE"),
        "notebook_CPU_NUM_DEVICES": os.environ.get("CPU_NUM_DEVICES"),
    }


def alive(pids: List[int]) -> List[int]:
    """Those of ``pids`` still running (a zombie, ended but not yet reaped, is not)."""
    import psutil

    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def _run_time(total: int, timings: List[str]) -> None:
    """bench/run's own section: how long the whole run and each benchmark took."""
    took = {name: int(seconds) for name, seconds in (t.split("=", 1) for t in timings)}
    rows = "\n".join(f"| `{name}` | {seconds} |" for name, seconds in took.items())
    goal = "met" if total < 600 else "**not met**"
    markdown = (f"## The whole run\n\n`bench/run` took **{total} s** ({total / 60:.1f} min; "
                f"goal: under 10 minutes, {goal}).\n\n| benchmark | s |\n|---|---:|\n{rows}\n")
    write_section("run", markdown, {"total_seconds": total, "benchmarks": took})


if __name__ == "__main__":  # bench/run's last step: python bench/_results.py run-time S NAME=S...
    if len(sys.argv) < 3 or sys.argv[1] != "run-time":
        sys.exit("usage: python bench/_results.py run-time SECONDS NAME=SECONDS...")
    _run_time(int(sys.argv[2]), sys.argv[3:])
