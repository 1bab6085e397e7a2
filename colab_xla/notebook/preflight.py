"""What is checked before any replica starts, each problem with the fix.

``run_cell`` refuses to start on a fatal problem and announces the others;
``%xla_doctor`` lists them all. Nothing here initializes the XLA runtime.

Example::

    >>> [p.code for p in environment_problems({"XLA_USE_SPMD": "1"})]
    ['spmd']
"""

from __future__ import annotations

import sys
import threading
from typing import Dict, List, Mapping, Optional, Tuple

from .. import runtimes
from ..runtimes import torch_xla as torch_xla_runtime
from ..errors import PreflightError, Problem, RuntimeInitializedError
from ..wire.cell import Cell

# What torch_xla sets for each replica process on a TPU host (torch_xla/_internal/pjrt.py
# initialize_multiprocess; tpu.py configure_topology), all with os.environ.setdefault, so a
# value inherited from the notebook wins over the one it would compute:
# * TPU_VISIBLE_CHIPS, TPU_PROCESS_PORT, CLOUD_TPU_TASK_ID, PJRT_LOCAL_PROCESS_RANK differ
#   between processes: inherited, every process takes the same chip, port and task id.
# * TPU_PROCESS_ADDRESSES, TPU_PROCESS_BOUNDS, TPU_CHIPS_PER_PROCESS_BOUNDS,
#   PJRT_LOCAL_PROCESS_COUNT describe this launch: inherited, they describe another one.
#   Kaggle's image sets TPU_PROCESS_ADDRESSES=local (for TensorFlow): one address for eight
#   processes, libtpu's "Expected N worker addresses, got 1" (transformers#28204); Kaggle's
#   own notebooks pop it and CLOUD_TPU_TASK_ID. A TPU_PROCESS_BOUNDS in the launching
#   process also caps how many processes xmp.spawn starts (tpu.num_local_processes).
# All of these are removed for the replicas (see strip_topology for the one exception).
# Kept: TPU_SKIP_MDS_QUERY, TPU_ACCELERATOR_TYPE, TPU_HOST_BOUNDS, TPU_CHIPS_PER_HOST_BOUNDS,
# TPU_WORKER_ID, TPU_WORKER_HOSTNAMES (as on Colab). They describe the host, are the same
# for every process, and with TPU_SKIP_MDS_QUERY set they are where configure_topology
# reads the host from instead of the metadata server (tpu.build_tpu_env_from_vars):
# without them it fails (MeshShape.from_string(None)). On a one-chip host the bounds they
# give can disagree with the one process xmp.spawn starts; the torch_xla runtime's
# ONE_CHIP_TOPOLOGY covers that by setting the process topology itself.
TPU_TOPOLOGY_VARS = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID", "TPU_VISIBLE_CHIPS",
                     "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_PORT",
                     "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT")
# With TPU_SKIP_MDS_QUERY set, torch_xla reads the host's bounds from TPU_PROCESS_BOUNDS and
# TPU_CHIPS_PER_PROCESS_BOUNDS first and from these only when those are unset
# (tpu.build_tpu_env_from_vars).
_HOST_FALLBACK = {"TPU_PROCESS_BOUNDS": "TPU_HOST_BOUNDS",
                  "TPU_CHIPS_PER_PROCESS_BOUNDS": "TPU_CHIPS_PER_HOST_BOUNDS"}


def refusal(problem: Problem) -> PreflightError:
    """The error that refuses a run for the fatal ``problem`` (a runtime started in the
    notebook's process: :class:`RuntimeInitializedError`)."""
    kind = RuntimeInitializedError if runtimes.started_by(problem) else PreflightError
    return kind(problem)


def environment_problems(environ: Mapping[str, str]) -> List[Problem]:
    problems = []
    if environ.get("XLA_USE_SPMD", "0") not in ("", "0", "false", "False"):
        problems.append(Problem(
            "spmd", "XLA_USE_SPMD is set: SPMD runs one process that drives every device, and "
                    "xmp.spawn's one-replica-per-device model does not mix with it "
                    "(each replica would see the whole host).",
            "For %%xla_spawn, unset it (del os.environ['XLA_USE_SPMD']) and restart the "
            "runtime if torch_xla.runtime.use_spmd() was called. For SPMD, run the cell "
            "without %%xla_spawn."))
    stale = strip_topology(environ)
    if stale:
        problems.append(Problem(
            "topology", f"{', '.join(stale)} {'is' if len(stale) == 1 else 'are'} set in the "
                        "notebook's environment; torch_xla sets these for each replica process "
                        "but keeps values already set, so inherited ones would make replicas "
                        "collide or disagree on the topology.",
            "colab_xla removes them for the replicas; to silence this, unset them: "
            + "; ".join(f"os.environ.pop({v!r})" for v in stale), fatal=False))
    return problems


def strip_topology(environ: Mapping[str, str]) -> Tuple[str, ...]:
    """The stale topology variables that the replicas must not inherit.

    Not TPU_PROCESS_BOUNDS / TPU_CHIPS_PER_PROCESS_BOUNDS when TPU_SKIP_MDS_QUERY is set and
    TPU_HOST_BOUNDS / TPU_CHIPS_PER_HOST_BOUNDS are not: they are then torch_xla's only
    description of the host, and every replica would fail in configure_topology without.
    """
    skip_mds = bool(environ.get("TPU_SKIP_MDS_QUERY"))
    return tuple(v for v in TPU_TOPOLOGY_VARS if v in environ
                 and not (skip_mds and v in _HOST_FALLBACK and _HOST_FALLBACK[v] not in environ))


def topology_changes(environ: Mapping[str, str],
                     plan_env: Mapping[str, Optional[str]]) -> Dict[str, None]:
    """The variables to unset for the replicas: the stale ones, except those the replica
    plan sets itself (the torch_xla runtime's ONE_CHIP_TOPOLOGY)."""
    return {v: None for v in strip_topology(environ) if v not in plan_env}


_LAUNCHERS = {("xmp", "spawn"), ("xla_multiprocessing", "spawn"), ("torch_xla", "launch"),
              ("pjrt", "spawn"), ("pjrt", "run_multiprocess")}


def cell_problems(cell: Optional[Cell]) -> List[Problem]:
    """A cell that launches replicas itself would launch them from every replica. (A cell
    with a syntax error has no calls: compiling it says where.)"""
    for line, owner, name in cell.calls() if cell is not None else ():
        if (owner, name) in _LAUNCHERS:
            return [Problem(
                "nested-spawn", f"line {line} of the cell calls "
                                f"{owner}.{name}(...): %%xla_spawn already runs the "
                                "cell on every replica, so each replica would start replicas.",
                "Put the body of your function in the cell instead of spawning it; `index` "
                "is the ordinal xmp.spawn would pass. Or run xmp.spawn in a plain cell, "
                "without %%xla_spawn.")]
    return []


def runtime_problems() -> List[Problem]:
    """torch_xla's refusal (this process initialized the XLA runtime), for a run of any
    runtime and every cell of a session: this process imports torch_xla whatever the
    runtime (the TPU scan, the launcher), its replicas fork from it, and each replica asks
    torch_xla whether its client started (colab_xla.runtimes.runtime_clients)."""
    return torch_xla_runtime.RUNTIME.problems()


# Threads every kernel runs (ipykernel's IOPub, heartbeat, control, parent poller; IPython's
# history saver; zmq's and tornado's), colab_xla's own and those of the pools it starts, and
# torch's compile-worker reader (torch 2.8 starts it with torch_xla): a forked replica never
# touches what they hold (it has its own streams and channel), so they are no reason to warn.
_KERNEL_THREAD_MODULES = ("ipykernel", "IPython", "jupyter_client", "zmq", "tornado",
                          "asyncio", "colab_xla", "concurrent.futures", "multiprocessing",
                          "torch._inductor.compile_worker")


def foreign_threads() -> List[threading.Thread]:
    """Threads of this process other than the main thread, the kernel's and colab_xla's:
    the ones a lock held at fork time could belong to (the cell's, a library's)."""
    found = []
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.name.startswith("colab_xla"):
            continue
        target = getattr(thread, "_target", None)
        module = getattr(target, "__module__", None) or type(thread).__module__
        if not module.startswith(_KERNEL_THREAD_MODULES):
            found.append(thread)
    return found


def launch_problems(launch, environ: Mapping[str, str], *, python=sys.version_info,
                    threads: Optional[int] = None,
                    cuda_initialized: Optional[bool] = None) -> List[Problem]:
    """When the chosen way to start replicas is unsafe here, with the way that is safe.

    ``threads`` and ``cuda_initialized`` default to this process's.
    """
    problems = []
    if launch.launcher == "launch" and not launch.debug_single and "TORCHELASTIC_RUN_ID" in environ:
        problems.append(Problem(
            "torchelastic", "this notebook runs under torchrun (TORCHELASTIC_RUN_ID is set), "
                            "where torch_xla.launch calls the function in the calling process: "
                            "the replica would run in the notebook's own process.",
            "Use --launcher xmp (the default)."))
    if launch.start_method != "fork":
        return problems
    if cuda_initialized is None:
        torch = sys.modules.get("torch")
        cuda_initialized = bool(torch is not None and torch.cuda.is_initialized())
    if cuda_initialized:
        problems.append(Problem(
            "fork-cuda", "CUDA is initialized in this notebook's process, and a forked "
                         "replica cannot use CUDA (it fails or hangs on its first CUDA call).",
            "Use --start-method forkserver (warm after its first run, about as fast as fork) "
            "or --start-method spawn.", fatal=False))
    threads = len(foreign_threads()) if threads is None else threads
    if python >= (3, 12) and threads > 0:
        problems.append(Problem(
            "fork-threads", f"this process runs {threads} thread{'s' if threads != 1 else ''} "
                            "besides the kernel's, and Python 3.12+ warns "
                            "that fork of a multi-threaded process may deadlock the child (a "
                            "lock another thread held at the fork stays locked in it).",
            "colab_xla forks holding none of its own locks; if replicas hang before their "
            "first line, use --start-method forkserver.", fatal=False))
    return problems


def leftovers_problem(found) -> Optional[Problem]:
    """Processes of earlier runs whose notebook process is gone (``processes.leftovers()``)."""
    if not found:
        return None
    return Problem(
        "leftovers", f"{len(found)} process(es) started by an earlier run of colab_xla in a "
                     "notebook process that is gone are still alive and may hold the TPU: "
                     + "; ".join(f.describe() for f in found) + ".",
        "Remove them with %xla_doctor --kill-leftovers (it kills exactly these, by pid and "
        "start time).", fatal=False)


def check(cell: Optional[Cell], environ: Mapping[str, str], launch=None,
          device_type: Optional[str] = None,
          refuse_tpu_holders: bool = True) -> Dict[str, List[Problem]]:
    """Problems of this cell (None: of a session's start, no cell yet) in this environment:
    ``{"fatal": [...], "notes": [...]}``. ``device_type`` is the plan's: a TPU run also
    checks who holds the TPU (a refusal, or with ``refuse_tpu_holders`` False a note:
    :meth:`colab_xla.notebook.defaults.Defaults.refuses_tpu_holders`); ``launch``'s
    runtime adds what it refuses itself."""
    found = cell_problems(cell) + environment_problems(environ) + runtime_problems()
    if launch is not None:
        found += launch_problems(launch, environ)
    if device_type == "TPU":
        from . import processes, tpu_holders
        found += tpu_holders.problems(tpu_holders.scan(),
                                      {left.pid for left in processes.leftovers()},
                                      refuse=refuse_tpu_holders)
    if launch is not None:  # (torch_xla's own is runtime_problems(), found above)
        found += [p for p in launch.runtime.problems() if p not in found]
    return {"fatal": [p for p in found if p.fatal], "notes": [p for p in found if not p.fatal]}
