"""The launcher's entry into the replicas: the only module of the replica side that the
notebook's side imports (:mod:`colab_xla.notebook.launch` does, and nothing else).

* :func:`main`: what every replica of a one-off run runs, ``main(index, job)``;
  :func:`serve`: what every replica of a session runs, cell after cell.
* :func:`replica_process`: a process the launcher starts itself (one per replica on CPU,
  and JAX processes); :func:`single_replica`: the process of ``--debug-single``.
* :func:`inherit`: in the notebook, around the start of forked replicas: what they inherit
  instead of receiving it pickled.
"""

from __future__ import annotations

import gc
import os
from typing import Callable, Dict

from .. import runtimes
from ..wire.job import arrived
from .execution import main
from .process import inherit
from .serve import serve

__all__ = ["main", "serve", "inherit", "replica_process", "single_replica"]


def replica_process(entry: Callable, index: int, job, rank_env: Dict[str, str],
                     forked: bool) -> None:
    """A replica process colab_xla starts itself (the CPU simulation's, a JAX process):
    its rank, then the replica, then what its runtime does after it."""
    if forked:  # its arguments were not pickled, so the job has not arrived yet
        # What it inherited from the notebook goes to the collector's permanent generation
        # first (gc.freeze moves list heads: it touches no object), so that no full
        # collection here walks it, writing to every page it shares with the notebook (as
        # a JAX process's backend start would: bench/jax_runtime.py). Not frozen in the
        # notebook as it forks: that would promote the notebook's young garbage to its
        # oldest generation every run, and its memory would grow run after run.
        gc.freeze()
        arrived(job)
    # LOCAL_RANK: what libraries read for the local rank off a TPU (accelerate on CPU).
    os.environ.update(rank_env, PJRT_LOCAL_PROCESS_RANK=str(index), LOCAL_RANK=str(index))
    entry(index, job)
    if job.environ is not None:  # (JAX: it waits for the others to end)
        runtimes.current(job.environ).after_process()


def single_replica(entry: Callable, job) -> None:
    """The process of ``--debug-single``: torch_xla runs the replica right here."""
    job.apply_environ()  # a forked Process gets its arguments without pickling
    import torch_xla

    torch_xla.launch(entry, args=(job,), debug_single_process=True)
