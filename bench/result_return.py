"""Large results back to the notebook: shared memory against pickling, with memcpy as the limit.

Every replica holds a CPU tensor of ``--mib`` MiB (4 replicas x 256 MiB by default) and
sends it back. Measured, interleaved, in one process:

* memcpy (warm):  ``dst.copy_(src)`` of the same total into memory already touched: the
                  machine's copy speed, an upper bound no transfer reaches;
* memcpy (fresh): ``torch.empty_like(src).copy_(src)``: a copy into new pages, which the
                  kernel must first allocate and zero, as it must for any transfer;
* shm:            ``run_cell`` returning the tensor (``-o``): written once into
                  ``/dev/shm`` by the replica, mapped by the notebook (colab_xla's path);
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

import multiprocessing
import os
import pickle
import sys
import time
from typing import Dict, List

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import (bench_parser, machine_info, machine_line, publish,  # noqa: E402
                      stats)

import torch  # noqa: E402

from colab_xla.transport import shared_tensors  # noqa: E402
from colab_xla.run import run_cell  # noqa: E402

NAME = "result_return"
PATHS = ("memcpy_warm", "memcpy_fresh", "shm", "inline", "pipe")
LABELS = {"memcpy_warm": "memcpy, warm memory (limit)", "memcpy_fresh": "memcpy into new pages",
          "shm": "`%%xla_spawn -o`, shared memory", "inline": "`%%xla_spawn -o`, pickled inline",
          "pipe": "pickle through a pipe"}

CELL = """
import time, torch, torch_xla.core.xla_model as xm
t = torch.full(({elements},), float(index))
xm.rendezvous("ready")          # every replica holds its tensor
stamp = time.monotonic()
(stamp, t)
"""


def run_colab_xla(replicas: int, elements: int, shared: bool) -> float:
    saved = shared_tensors.MIN_BYTES
    if not shared:  # forked replicas inherit this: every tensor goes inline
        shared_tensors.MIN_BYTES = float("inf")
    try:
        outcome = run_cell(CELL.format(elements=elements), replicas=replicas, announce=None)
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


def run_memcpy(replicas: int, elements: int, fresh: bool, src: List[torch.Tensor],
               dst: List[torch.Tensor]) -> float:
    t0 = time.monotonic()
    for i in range(replicas):
        if fresh:
            torch.empty_like(src[i]).copy_(src[i])
        else:
            dst[i].copy_(src[i])
    return time.monotonic() - t0


def measure(replicas: int, mib: int, repeats: int) -> dict:
    elements = mib * 2**20 // 4  # float32
    total = replicas * elements * 4
    src = [torch.full((elements,), float(i)) for i in range(replicas)]
    dst = [torch.empty_like(s).fill_(0) for s in src]  # touched: pages exist
    paths = {
        "memcpy_warm": lambda: run_memcpy(replicas, elements, False, src, dst),
        "memcpy_fresh": lambda: run_memcpy(replicas, elements, True, src, dst),
        "shm": lambda: run_colab_xla(replicas, elements, True),
        "inline": lambda: run_colab_xla(replicas, elements, False),
        "pipe": lambda: run_pipe(replicas, elements),
    }
    run_colab_xla(replicas, 1024, True)  # warm: imports, the first fork
    seconds: Dict[str, List[float]] = {p: [] for p in PATHS}
    for i in range(repeats):
        order = PATHS[i % len(PATHS):] + PATHS[:i % len(PATHS)]
        for name in order:
            seconds[name].append(paths[name]())
    gbps = {p: [total / s / 1e9 for s in seconds[p]] for p in PATHS}
    return {"replicas": replicas, "mib_each": mib, "total_bytes": total,
            "seconds": seconds, "gbps": {p: stats(v) for p, v in gbps.items()},
            "shared_memory": os.path.isdir(shared_tensors.SHM_ROOT)}


def render(r: dict, info: dict, seconds: float) -> str:
    g = r["gbps"]
    limit = g["memcpy_warm"]["median"]
    lines = [
        "## Result return: large tensors from the replicas",
        "",
        f"{r['replicas']} replicas each return a {r['mib_each']} MiB CPU tensor "
        f"({r['total_bytes'] / 2**30:.0f} GiB in all), timed from all replicas holding "
        "their tensor to the notebook holding all of them. GB/s median (p10-p90), and "
        "the share of warm memcpy.",
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
        f"Shared memory is {g['shm']['median'] / g['pipe']['median']:.1f}x pickling through a "
        f"pipe and {g['shm']['median'] / g['inline']['median']:.1f}x the inline pickle, in the "
        "same run. What it still pays is the kernel allocating and zeroing the new pages "
        "(compare memcpy into new pages), and the replica's one copy into them; the notebook "
        "maps them without copying.",
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
