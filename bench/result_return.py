"""Large results back to the notebook: shared memory against pickling, against memcpy.

Every replica holds a CPU tensor of ``--mib`` MiB (4 replicas x 256 MiB by default) and
sends it back. Measured, interleaved, in one process (the notebook's):

* memcpy (warm):  the reference (``_results.Memcpy``, shared with ``peers.py``):
                  ``dst.copy_(src)`` of the same tensors into destinations written before;
* memcpy (fresh): ``torch.empty_like(src).copy_(src)``: a copy into new pages, which the
                  kernel must first allocate and zero;
* shm:            ``run_cell`` returning the tensor (``-o``): written once into
                  ``/dev/shm`` by the replica, mapped by the notebook (colab_xla's path),
                  into the pages the previous run's freed results left (as in a loop);
* shm, new pages: the same with those pages given back first (a first result);
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

from _results import (MEMCPY_PROSE, Memcpy, bench_parser, machine_info, rotated,  # noqa: E402
                      machine_line, publish, stats)

import torch  # noqa: E402

from colab_xla.transport import shared_tensors  # noqa: E402
from colab_xla.run import run_cell  # noqa: E402

NAME = "result_return"
PATHS = ("memcpy_warm", "memcpy_fresh", "shm", "shm_new", "inline", "pipe")
LABELS = {"memcpy_warm": "memcpy, warm (the reference)", "memcpy_fresh": "memcpy into new pages",
          "shm": "`%%xla_spawn -o`, shared memory, reused pages",
          "shm_new": "`%%xla_spawn -o`, shared memory, new pages",
          "inline": "`%%xla_spawn -o`, pickled inline", "pipe": "pickle through a pipe"}

CELL = """
import time, torch, torch_xla.core.xla_model as xm
t = torch.full(({elements},), float(index))
xm.rendezvous("ready")          # every replica holds its tensor
stamp = time.monotonic()
(stamp, t)
"""


def run_colab_xla(replicas: int, elements: int, shared: bool, new_pages: bool = False) -> float:
    if new_pages:
        shared_tensors.drop_free_pages()
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


def run_memcpy_fresh(src: List[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for s in src:
        torch.empty_like(s).copy_(s)
    return time.perf_counter() - t0


def measure(replicas: int, mib: int, repeats: int) -> dict:
    elements = mib * 2**20 // 4  # float32
    total = replicas * elements * 4
    reference = Memcpy(elements * 4, replicas)
    paths = {
        "memcpy_warm": reference.seconds,
        "memcpy_fresh": lambda: run_memcpy_fresh(reference.src),  # (the same tensors)
        "shm": lambda: run_colab_xla(replicas, elements, True),
        "shm_new": lambda: run_colab_xla(replicas, elements, True, new_pages=True),
        "inline": lambda: run_colab_xla(replicas, elements, False),
        "pipe": lambda: run_pipe(replicas, elements),
    }
    run_colab_xla(replicas, 1024, True)  # warm: imports, the first fork
    run_colab_xla(replicas, elements, True)  # its freed results' pages are the first reused
    seconds: Dict[str, List[float]] = {p: [] for p in PATHS}
    for i in range(repeats):
        for name in rotated(PATHS, i):
            seconds[name].append(paths[name]())
    gbps = {p: [total / s / 1e9 for s in seconds[p]] for p in PATHS}
    return {"replicas": replicas, "mib_each": mib, "total_bytes": total,
            "seconds": seconds, "gbps": {p: stats(v) for p, v in gbps.items()},
            "shared_memory": os.path.isdir(shared_tensors.SHM_ROOT)}


PROFILE = (
    "Where the time goes (py-spy and a timeline of one run; per-CPU-second rates of the "
    "single operations, measured alone): each replica's one copy, a `pwrite` of its tensor "
    "into a `/dev/shm` file, is most of it; into new tmpfs pages it runs at ~2.4 GB/s per "
    "CPU-second (the kernel allocates and charges every 4 KiB page), into pages that exist "
    "at ~3.9, against ~20 for the warm `copy_` of the reference (in one thread; no huge "
    "pages on either side here). Hence the reused pages. The reference writes its "
    "destinations again, untimed, before each timed copy: each fork of the runs around it "
    "write-protects the notebook's pages, and the copy would time copy-on-write faults "
    "(~8 GB/s). Mapping and populating a file then copying into it costs the same as "
    "`pwrite` (34 ms of page tables per 256 MiB), so the replica keeps `pwrite`. The "
    "notebook maps each file without copying or touching it: its first touch of a page "
    "faults it in later (~0.1 s per GiB, not counted here). The rest is the replicas' "
    "processes ending (~40 ms) and the report; there is no checksum.")


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
        f"Shared memory is {g['shm']['median'] / g['pipe']['median']:.1f}x pickling through a "
        f"pipe and {g['shm']['median'] / g['inline']['median']:.1f}x the inline pickle, in the "
        "same run. " + PROFILE,
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
