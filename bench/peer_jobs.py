"""The work every peer runs: module-level functions, so each launcher can start them.

``xmp.spawn`` calls ``fn(index, *args)``; ``accelerate.notebook_launcher`` calls
``fn(*args)`` in each worker (the rank is in ``$RANK``); a ``%%px`` or ``%%xla_spawn`` cell
calls them with its own ``index``. ``index=None`` means: take the rank from the launcher.
"""

from __future__ import annotations

import multiprocessing
import os
import time


def replica_index(index=None) -> int:
    return int(os.environ.get("RANK", "0")) if index is None else int(index)


def trivial(index=None):
    return replica_index(index)


def fork_each(n: int, fn=trivial) -> None:
    """The floor of one process per replica (as on a TPU v4 or later host, and the CPU
    simulation's default): fork ``n`` processes that each call ``fn(index)``, wait for all."""
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=fn, args=(index,)) for index in range(n)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    codes = [process.exitcode for process in processes]
    if any(codes):
        raise RuntimeError(f"fork_each({n}): exit codes {codes}")


def stamp(index=None, sleep=1.0):
    """Print one line carrying the wall-clock time taken just before it, then wait."""
    i = replica_index(index)
    t = time.time()
    print(f"stamp {i} {t!r}")
    time.sleep(sleep)


def printer(index=None, n=0):
    i = replica_index(index)
    for k in range(n):
        print(f"r{i} line {k}")


def tensor(index=None, mib=256):
    """A CPU float32 tensor of ``mib`` MiB filled with the replica's index."""
    import torch

    return torch.full((mib << 18,), float(replica_index(index)))


def tensor_size(index=None, mib=256):
    """The same work as ``tensor``, returning only the tensor's size."""
    return tensor(index, mib).numel()


def forever(index=None, marker_dir=None):
    """Say it started (a file ``started-INDEX`` in ``marker_dir``), then wait until killed."""
    i = replica_index(index)
    if marker_dir:
        with open(os.path.join(marker_dir, f"started-{i}"), "w"):
            pass
    while True:
        time.sleep(0.05)
