"""Large results back to the notebook: shared memory against pickling, against memcpy.

Every replica holds a CPU tensor of ``--mib`` MiB (4 replicas x 256 MiB by default) and
sends it back. Measured, interleaved, in one process (the notebook's):

* memcpy (warm):  the reference (``_results.Memcpy``, shared with ``peers.py``): the same
                  tensors copied into destinations written before, the faster of
                  ``dst.copy_(src)`` and a whole tensor per thread by ``memmove``;
* memcpy (fresh): ``torch.empty_like(src).copy_(src)``: a copy into new pages, which the
                  kernel must first allocate and zero;
* tmpfs write:    the same tensors ``pwrite`` into ``/dev/shm`` files whose pages exist,
                  from as many threads as torch uses: the one copy the shm path makes,
                  alone (its ceiling: no replicas, no processes to end);
* shm:            ``run_cell`` returning the tensor (``-o``): written once into
                  ``/dev/shm`` by the replica, mapped by the notebook (colab_xla's path),
                  into the pages the previous run's freed results left (as in a loop);
* shm, new pages: the same with those pages given back first (a first result);
* shm, session:   the same cell on a warm session (``%xla_session``, started once), right
                  after an untimed one whose results were freed (as in a loop: the other
                  paths' runs share the page pool): no processes start or end around the
                  return, and each replica writes into the pages it wrote the cell before;
* inline:         the same run with shared memory turned off: the tensor is pickled into
                  the replica's report and unpickled by the notebook (colab_xla before);
* pipe:           forked processes ``pickle.dumps`` their tensor and send the bytes through
                  a pipe; the parent reads and unpickles them (a hand-made
                  ``multiprocessing.Pipe`` without torch's shared-memory reductions).

Transfers are timed from the moment every replica holds its tensor (they meet at a
barrier, then stamp ``time.monotonic()``, which is system-wide) until the notebook holds
all of them; each result is checked. GB/s = total bytes / that time (1 GB = 1e9 bytes).
Writes the "result_return" section of results.md and results/result_return.json.

    python bench/result_return.py [--mib 256] [--replicas 4] [--repeats 5]
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import multiprocessing
import os
import pickle
import sys
import time
from typing import Dict, List

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (MEMCPY_PROSE, bench_parser, fastest, machine_info,  # noqa: E402
                      machine_line, memcpy_ways, publish, rotated, stats, ways_prose)

import torch  # noqa: E402

from colab_xla.wire import shared_tensors  # noqa: E402
from colab_xla.notebook.targets import run_cell, start_session, stop_session  # noqa: E402
from colab_xla.notebook.targets.session import SessionOptions  # noqa: E402

NAME = "result_return"
PATHS = ("memcpy_warm", "memcpy_fresh", "tmpfs_write", "shm", "shm_session", "shm_new", "inline",
         "pipe")
LABELS = {"memcpy_warm": "memcpy, warm (the reference)", "memcpy_fresh": "memcpy into new pages",
          "tmpfs_write": "`pwrite` into `/dev/shm` pages that exist (the shm path's copy alone)",
          "shm": "`%%xla_spawn -o`, shared memory, reused pages",
          "shm_session": "`%%xla_spawn -o` on a warm session, shared memory, reused pages",
          "shm_new": "`%%xla_spawn -o`, shared memory, new pages",
          "inline": "`%%xla_spawn -o`, pickled inline", "pipe": "pickle through a pipe"}

CELL = """
import time, torch, torch_xla.core.xla_model as xm
t = torch.full(({elements},), float(index))
xm.rendezvous("ready")          # every replica holds its tensor
stamp = time.monotonic()
(stamp, t)
"""


def run_colab_xla(replicas: int, elements: int, shared: bool, new_pages: bool = False,
                  session=None) -> float:
    if new_pages:
        shared_tensors.drop_free_pages()
    saved = shared_tensors.MIN_BYTES
    if not shared:  # forked replicas inherit this: every tensor goes inline
        shared_tensors.MIN_BYTES = float("inf")
    try:
        outcome = run_cell(CELL.format(elements=elements), announce=None,
                           **({"session": session} if session else {"replicas": replicas}))
        done = time.monotonic()
    finally:
        shared_tensors.MIN_BYTES = saved
    results = outcome.results()
    if sorted(results) != list(range(replicas)):
        raise RuntimeError(f"run failed: {[r.error for r in outcome.replicas.values()]}")
    for o, (_, t) in results.items():
        if t.numel() != elements or float(t[0]) != o or float(t[-1]) != o:
            raise RuntimeError(f"replica {o}: wrong tensor")
    return done - min(stamp for stamp, _ in results.values())


def _pipe_child(index: int, elements: int, barrier, conn) -> None:
    # Forked from a thread that ran torch's OpenMP pool (the memcpy path): GNU OpenMP
    # hangs in the child's first parallel op, so this child stays single-threaded.
    # (colab_xla forks from a driver thread that never ran one.)
    torch.set_num_threads(1)
    t = torch.full((elements,), float(index))
    barrier.wait()
    conn.send_bytes(pickle.dumps((time.monotonic(), t), protocol=pickle.HIGHEST_PROTOCOL))
    conn.close()


def run_pipe(replicas: int, elements: int) -> float:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(replicas)
    pipes = [ctx.Pipe(duplex=False) for _ in range(replicas)]
    procs = [ctx.Process(target=_pipe_child, args=(i, elements, barrier, w))
             for i, (_, w) in enumerate(pipes)]
    for p in procs:
        p.start()
    values = [pickle.loads(r.recv_bytes()) for r, _ in pipes]
    done = time.monotonic()
    for p in procs:
        p.join()
    for o, (_, t) in enumerate(values):
        if t.numel() != elements or float(t[0]) != o:
            raise RuntimeError(f"pipe child {o}: wrong tensor")
    return done - min(stamp for stamp, _ in values)


def sources(count: int, elements: int) -> List[torch.Tensor]:
    """The notebook-side paths' tensors, made for each measurement and freed after it: held
    between them, their pages would be copied at every replica fork and torn down at every
    replica exit of the runs measured in between."""
    return [torch.full((elements,), float(i)) for i in range(count)]


def run_memcpy_fresh(count: int, elements: int) -> float:
    src = sources(count, elements)
    t0 = time.perf_counter()
    for s in src:
        torch.empty_like(s).copy_(s)
    return time.perf_counter() - t0


class TmpfsWrite:
    """What the shared-memory path's one copy costs alone: ``count`` tensors each written by
    one ``pwrite`` into a ``/dev/shm`` file whose pages exist (as the replicas write into
    the pages of freed results), from as many threads as torch's copy uses."""

    def __init__(self, count: int, elements: int):
        self.count, self.elements = count, elements
        self.paths = [os.path.join(shared_tensors.SHM_ROOT, f"colab_xla-bench-{os.getpid()}-{i}")
                      for i in range(count)]
        self.pool = concurrent.futures.ThreadPoolExecutor(torch.get_num_threads())
        self.seconds()  # first write untimed: it allocates the pages

    @staticmethod
    def _write(path: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            written = 0
            while written < nbytes:
                written += os.pwrite(fd, view[written:], written)
        finally:
            os.close(fd)

    def seconds(self) -> float:
        src = sources(self.count, self.elements)
        started = time.perf_counter()
        list(self.pool.map(self._write, self.paths, src))
        return time.perf_counter() - started

    def close(self) -> None:
        self.pool.shutdown()
        for path in self.paths:
            os.unlink(path)


def measure(replicas: int, mib: int, repeats: int) -> dict:
    elements = mib * 2**20 // 4  # float32
    total = replicas * elements * 4
    tmpfs = TmpfsWrite(replicas, elements)
    session = start_session(SessionOptions(replicas=replicas), {}, announce=None)
    ways: List[Dict[str, float]] = []  # each memcpy sample's two ways

    def memcpy_warm() -> float:
        ways.extend(memcpy_ways(elements * 4, replicas, 1))
        return fastest(ways[-1])

    paths = {
        "memcpy_warm": memcpy_warm,
        "memcpy_fresh": lambda: run_memcpy_fresh(replicas, elements),
        "tmpfs_write": tmpfs.seconds,
        "shm": lambda: run_colab_xla(replicas, elements, True),
        "shm_session": lambda: (run_colab_xla(replicas, elements, True, session=session),
                                run_colab_xla(replicas, elements, True, session=session))[1],
        "shm_new": lambda: run_colab_xla(replicas, elements, True, new_pages=True),
        "inline": lambda: run_colab_xla(replicas, elements, False),
        "pipe": lambda: run_pipe(replicas, elements),
    }
    seconds: Dict[str, List[float]] = {p: [] for p in PATHS}
    try:
        for warm in (session, None):  # imports, the first fork; then pages for the first reuse
            run_colab_xla(replicas, 1024, True, session=warm)
            run_colab_xla(replicas, elements, True, session=warm)
        for i in range(repeats):
            for name in rotated(PATHS, i):
                seconds[name].append(paths[name]())
    finally:
        tmpfs.close()
        stop_session()
    gbps = {p: [total / s / 1e9 for s in seconds[p]] for p in PATHS}
    return {"replicas": replicas, "mib_each": mib, "total_bytes": total,
            "seconds": seconds, "gbps": {p: stats(v) for p, v in gbps.items()},
            "memcpy_ways_s": ways,
            "shared_memory": os.path.isdir(shared_tensors.SHM_ROOT)}


PROFILE = (
    "Where the time goes (measured once, outside this benchmark: a timeline of runs with "
    "stamps in the replicas, and per-CPU-second rates of the single operations, each alone, "
    "in one thread, no huge pages here): of a shared-memory run's ~155 ms, the replicas' "
    "`pwrite`s (4 at once on the 2 cores) end at ~85 ms; each replica's report, and its "
    "loading in the notebook, take under 1 ms; then the replicas' processes take ~60 ms to "
    "end, the kernel freeing each one's 256 MiB tensor (~17 ms) and the address space it "
    "inherited from the notebook (~10 ms) on the same 2 cores. `pwrite` into tmpfs pages that "
    "exist runs at ~7.5 GB/s per CPU-second, against ~16.5 for the warm `copy_` (the kernel "
    "finds and locks every 4 KiB page), and into new pages at ~2.4 (it allocates and charges "
    "every page): hence the reused pages. The other ways to make the one copy cost more: "
    "mapping the file and copying into it, ~2.7 GB/s per CPU-second (a page fault per 4 KiB; "
    "~4.9 with `MADV_POPULATE_READ` first), and the notebook reading each replica's tensor with "
    "`process_vm_readv`, ~7 (with the replica kept alive until it is read). The notebook maps "
    "each file without copying or touching it: its first touch of a page faults it in later "
    "(~0.1 s per GiB, not counted here). The reference writes its destinations again, "
    "untimed, before each timed copy: each fork of the runs around it write-protects the "
    "notebook's pages, and the copy would time copy-on-write faults (~8 GB/s).")


def render(r: dict, info: dict, seconds: float) -> str:
    g = r["gbps"]
    limit = g["memcpy_warm"]["median"]
    lines = [
        "## Result return: large tensors from the replicas",
        "",
        f"{r['replicas']} replicas each return a {r['mib_each']} MiB CPU tensor "
        f"({r['total_bytes'] / 2**30:.0f} GiB in all), timed from all replicas holding "
        "their tensor to the notebook holding all of them (mapped; checked at both ends). GB/s "
        f"median (p10-p90), and the share of the reference: {MEMCPY_PROSE}.",
        "",
        "| path | GB/s | of memcpy | ms |",
        "|---|---:|---:|---:|",
    ]
    for p in PATHS:
        ms = stats([s * 1e3 for s in r["seconds"][p]])["median"]
        lines.append(f"| {LABELS[p]} | {g[p]['median']:.2f} ({g[p]['p10']:.2f}-{g[p]['p90']:.2f}) "
                     f"| {g[p]['median'] / limit:.0%} | {ms:.0f} |")
    lines += [
        "",
        f"The reference's two ways: {ways_prose(r['memcpy_ways_s'], r['total_bytes'])}. "
        f"Shared memory is {g['shm']['median'] / g['pipe']['median']:.1f}x pickling through a "
        f"pipe and {g['shm']['median'] / g['inline']['median']:.1f}x the inline pickle, in the "
        f"same run. Its one copy, made alone in the notebook (`pwrite` row), runs at "
        f"{g['tmpfs_write']['median'] / limit:.0%} of memcpy: that is the ceiling of a path "
        "that copies once through tmpfs; the whole path reaches "
        f"{g['shm']['median'] / g['tmpfs_write']['median']:.0%} of it. " + PROFILE,
        "",
        machine_line(info, NAME, seconds, f"{len(r['seconds']['shm'])} repeats per path, "
                     "interleaved"),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--mib", type=int, default=256, help="MiB per replica (256)")
    parser.add_argument("--replicas", type=int, default=4, help="replicas (4)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per path (5)")
    args = parser.parse_args(argv)
    if args.repeats < 2 or args.mib < 1 or args.replicas < 1:
        parser.error("need --repeats >= 2, --mib >= 1, --replicas >= 1")
    started = time.perf_counter()
    info = machine_info(args.repeats, 1)
    result = measure(args.replicas, args.mib, args.repeats)
    print("result_return: " + ", ".join(f"{p} {result['gbps'][p]['median']:.2f} GB/s"
                                        for p in PATHS), file=sys.stderr)
    seconds = time.perf_counter() - started
    return publish(NAME, render(result, info, seconds),
                   {"machine": info, "seconds": seconds, "result": result}, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
