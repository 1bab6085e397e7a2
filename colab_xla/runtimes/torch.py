"""PyTorch's own distributed processes (``%%xla_spawn --runtime torch``): the cell runs in N
processes with torchrun's variables and the default process group initialized before it,
as a script that torchrun starts: on CPU with gloo (workshops, laptops), on CUDA GPUs with
NCCL (one process per GPU), on a TPU host with TorchTPU (``torch_tpu``: not yet, see
:func:`plan`).

Both halves of the runtime live here (:class:`Torch`), IPython-free:

* the notebook's: :func:`plan` (the processes and their device), and the guard that refuses
  a notebook whose own process initialized CUDA (forked CUDA children fail);
* the replica's: :func:`join` (torchrun's variables, from the rank the launcher gave the
  process, and on a cluster from its host's), :func:`initialize` (the default process
  group, once per process, before its first cell) and :func:`to_host` (tensors to CPU).

A cell written as a torchrun script runs unchanged: its
``dist.init_process_group(...)`` finds the group made and returns (a backend other than the
group's is refused, naming both), and its ``dist.destroy_process_group()`` of the default
group is put off to the process's end, so a session's next cell still has it.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os
import re
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..errors import OptionError, Problem, SetupError
from ..wire.host_rank import HostRank
from .base import VARIABLE, Runtime, refuse_xmp_launch
from .plan import Hardware, ReplicaCountError, ReplicaPlan
from .torch_xla import DEFAULT_CPU_REPLICAS

# The process group's backend on each device.
BACKENDS = {"CPU": "gloo", "CUDA": "nccl", "TPU": "tpu_dist"}
# Where a run's processes meet (``address:port``): host 0's on a cluster; else the
# launcher's MASTER_ADDR and MASTER_PORT of the run.
MASTER = "COLAB_XLA_TORCH_MASTER"
# The device of a run, as the plan chose it ("CPU", "CUDA"): the replicas' backend.
DEVICE = "COLAB_XLA_TORCH_DEVICE"
# More processes than this on CPU only slow the machine down (each is an interpreter).
MAX_CPU_PROCESSES = 16
# How long a collective waits for a peer before it raises (torch's default: 30 min for
# gloo, 10 for NCCL): a rank that failed leaves the others waiting, and the run is stopped
# by colab_xla before this in any case; a session's replica gets its error instead of a hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)

# The code of the preflight problem CUDA initialized in the notebook's process is.
CUDA_INITIALIZED = "cuda-initialized"
# Calls that initialize CUDA in the process that makes them.
STARTING_CALLS = re.compile(
    r"(\.cuda\(|\.to\(['\"]cuda|device\s*=\s*['\"]cuda|torch\.cuda\.(?:init|set_device|"
    r"current_device|synchronize|mem_get_info|get_device_properties|manual_seed)\(|"
    r"torch\.zeros\([^)]*cuda|torch\.(?:ones|randn|rand|empty|tensor)\([^)]*cuda)")

TORCH_INSTALL_HINT = "pip install torch, then restart the kernel."


# -- the notebook's side ------------------------------------------------------------------

def plan(requested: Optional[int], hw: Hardware, environ: Mapping[str, str],
         cuda_devices: Optional[int] = None) -> ReplicaPlan:
    """The :class:`colab_xla.runtimes.plan.ReplicaPlan` of a torch run: one process per
    replica (``index`` is its ``RANK``). ``cuda_devices``: the GPUs this machine has (None:
    counted here, without initializing CUDA). ``PJRT_DEVICE=CPU`` in the environment forces
    CPU processes, as it forces torch_xla's simulation (a workshop on a GPU machine)."""
    if requested is not None and requested < 1:
        raise ReplicaCountError(f"-n {requested}: the number of processes must be 1 or more.")
    forced_cpu = (environ.get("PJRT_DEVICE") or "").upper() == "CPU"
    if hw.device == "TPU" and not forced_cpu:
        raise ReplicaCountError(
            "--runtime torch on a TPU host needs TorchTPU (torch_tpu), which colab_xla does "
            "not drive yet: use the default runtime (torch_xla), or PJRT_DEVICE=CPU (--env "
            "PJRT_DEVICE=CPU) for gloo processes on the CPU.")
    gpus = 0 if forced_cpu else (cuda_devices if cuda_devices is not None
                                 else cuda_device_count())
    env: Dict[str, Optional[str]] = {VARIABLE: RUNTIME.name}
    if gpus:
        n = requested or gpus
        if n > gpus:
            raise ReplicaCountError(f"-n {n}: this machine has {gpus} CUDA GPU"
                                    f"{'s' if gpus != 1 else ''}, one process each; use -n "
                                    f"{gpus} or fewer (or PJRT_DEVICE=CPU for CPU processes).")
        env[DEVICE] = "CUDA"
        note = (f"colab_xla: torch runtime, {n} process{'es' if n != 1 else ''}, one per "
                "CUDA GPU (NCCL).")
        return ReplicaPlan("CUDA", n, env, note, processes=n, runtime=RUNTIME)
    n = requested or DEFAULT_CPU_REPLICAS
    if n > MAX_CPU_PROCESSES:
        raise ReplicaCountError(f"-n {n}: at most {MAX_CPU_PROCESSES} processes on CPU (each "
                                "is an interpreter of its own).")
    env[DEVICE] = "CPU"
    note = (f"colab_xla: torch runtime, {n} process{'es' if n != 1 else ''} on CPU "
            "(torch.distributed with gloo).")
    return ReplicaPlan("CPU", n, env, note, processes=n, runtime=RUNTIME)


def cuda_device_count() -> int:
    """The CUDA GPUs of this machine, without initializing CUDA in this process (NVML,
    as torch.cuda.device_count does before CUDA starts); 0 without torch's CUDA."""
    torch = sys.modules.get("torch")
    if torch is None:
        if importlib.util.find_spec("torch") is None:
            return 0
        import torch
    if not torch.backends.cuda.is_built():
        return 0
    return torch.cuda.device_count()  # (NVML: it does not initialize CUDA)


def cuda_problem() -> Optional[Problem]:
    """A :class:`colab_xla.errors.Problem` if this process (the notebook's) initialized
    CUDA, else None: processes forked from it cannot use CUDA ("Cannot re-initialize CUDA in
    forked subprocess")."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return Problem(
        CUDA_INITIALIZED,
        "CUDA is initialized in this notebook's own process (a tensor moved to a GPU, or a "
        "torch.cuda call, ran outside %%xla_spawn), so the processes forked from it cannot "
        "use CUDA.",
        "restart the kernel, then use the GPUs only inside %%xla_spawn --runtime torch cells "
        "(where `device` is each process's GPU).")


def check_installed() -> None:
    if importlib.util.find_spec("torch") is None:
        raise SetupError(f"--runtime torch needs PyTorch, which is not installed in this "
                         f"environment: {TORCH_INSTALL_HINT}")


# -- the replica's side ---------------------------------------------------------------------

def torchrun_environ(environ: Mapping[str, str]) -> Dict[str, str]:
    """The variables torchrun gives a worker, for a process whose launcher set
    ``PJRT_LOCAL_PROCESS_RANK``/``_COUNT`` (and on a cluster's host, its
    :class:`~colab_xla.wire.host_rank.HostRank` and :data:`MASTER`)."""
    local_rank = int(environ.get("PJRT_LOCAL_PROCESS_RANK", "0"))
    local_world = int(environ.get("PJRT_LOCAL_PROCESS_COUNT", "1"))
    host = HostRank.from_environ(environ)
    node, nodes = (host.host, host.hosts) if host else (0, 1)
    rank, world = (host.index(local_rank), host.world) if host else (local_rank, local_world)
    master = environ.get(MASTER)
    address, port = (master.rsplit(":", 1) if master else
                     (environ.get("MASTER_ADDR", "127.0.0.1"),
                      environ.get("MASTER_PORT", "29500")))
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(nodes), "NODE_RANK": str(node), "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
            "MASTER_ADDR": address, "MASTER_PORT": port,
            "TORCHELASTIC_RUN_ID": environ.get("COLAB_XLA_CLUSTER_RUN") or "colab_xla",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


_initialized = False
_membership: Dict[str, str] = {}  # torchrun's variables of this process (join)
_run_name = "colab_xla"  # the run (or session) the process serves: its store's key prefix
_store: List[Any] = []  # the process group's store, kept as long as the group


def join(environ: Mapping[str, str] = os.environ, run: str = "colab_xla") -> None:
    """In a new replica process: keep torchrun's variables, as the launcher's rank gives
    them (a session's later cells bring an environment without them: each cell gets them
    again, :func:`initialize`), and make the process group's calls fit for a cell written
    as a torchrun script (:func:`_fit_script_calls`)."""
    global _run_name
    _membership.update(torchrun_environ(environ))
    host = HostRank.from_environ(environ)
    _run_name = host.run if host and host.run else run  # (every host's: the same)
    _fit_script_calls()


def backend() -> str:
    return BACKENDS[os.environ.get(DEVICE, "CPU")]


def initialize() -> None:
    """Before each cell: torchrun's variables; the default process group, once per
    process."""
    global _initialized
    os.environ.update(_membership)
    if _initialized:
        return
    import torch
    import torch.distributed as dist

    if os.environ.get(DEVICE) == "CUDA":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # The store of env:// (a TCPStore at MASTER_ADDR:MASTER_PORT, served by rank 0), its
    # keys under this run's name: another run that happened to get the same free port
    # (two notebooks, two test workers) cannot mix its ranks with these.
    rank, world = int(_membership["RANK"]), int(_membership["WORLD_SIZE"])
    store = dist.TCPStore(_membership["MASTER_ADDR"], int(_membership["MASTER_PORT"]), world,
                          is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT)
    _store[:] = [store]
    _real["init"](backend(), store=dist.PrefixStore(f"colab_xla/{_run_name}", store),
                  rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    _initialized = dist.is_initialized()


def leave() -> None:
    """At the end of the process: the default process group goes."""
    global _initialized
    if _initialized:
        _real["destroy"]()
        _initialized = False
        _store.clear()


def device():
    """The cell's ``device``: this process's GPU, or the CPU."""
    import torch

    if os.environ.get(DEVICE) == "CUDA":
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


_real: Dict[str, Callable] = {}
# Backend names a script may give for the backend colab_xla made ("tpu": TorchTPU's alias).
_ALIASES = {"tpu": "tpu_dist"}


def _fit_script_calls() -> None:
    """``dist.init_process_group`` returns if the default group exists with that backend
    (another backend is refused, naming both), and ``dist.destroy_process_group()`` of the
    default group waits for the process's end (:func:`leave`)."""
    import torch.distributed as dist

    if _real:
        return
    _real.update(init=dist.init_process_group, destroy=dist.destroy_process_group)

    @functools.wraps(_real["init"])
    def init_process_group(backend=None, *args, **kwargs):
        if not dist.is_initialized():
            return _real["init"](backend, *args, **kwargs)
        asked = str(backend).lower() if backend is not None else None
        made = dist.get_backend()
        if asked is not None and made not in _ALIASES.get(asked, asked):
            raise ValueError(f"init_process_group(backend={backend!r}): colab_xla made this "
                             f"process's default group with {made!r} (--runtime torch on "
                             f"{os.environ.get(DEVICE, 'CPU')}); leave the backend out, or "
                             f"pass {made!r}.")
        return None

    @functools.wraps(_real["destroy"])
    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return None  # the default group: at the process's end (a session's next cell)
        return _real["destroy"](group)

    dist.init_process_group = init_process_group
    dist.destroy_process_group = destroy_process_group


def to_host(value: Any) -> Any:
    """``value`` with its tensors on the CPU (in lists, tuples and dicts too)."""
    if type(value) is dict:
        return {k: to_host(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(to_host(v) for v in value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.detach().cpu()
    return value


class Torch(Runtime):
    """N processes of one ``torch.distributed`` job (:mod:`colab_xla.runtimes.torch`)."""

    name = "torch"
    described_as = "torch.distributed processes"
    replicas_are = "processes"
    started_code = CUDA_INITIALIZED
    starting_calls = STARTING_CALLS
    preloads_torch_xla = False

    # -- the notebook's half ----------------------------------------------------------

    def check_installed(self) -> None:
        check_installed()

    def check_launch(self, launch) -> None:
        refuse_xmp_launch(launch, self.name, "its processes")
        if launch.devices_per_process is not None:
            raise OptionError("--devices-per-process is for --runtime jax (a torch process "
                              "has one device).")

    def plan(self, requested: Optional[int], hardware: Hardware, *,
             simulate: Optional[str] = None, devices_per_process: Optional[int] = None,
             environ: Optional[Mapping[str, str]] = None) -> ReplicaPlan:
        return plan(requested, hardware, environ or os.environ)

    def own_processes(self, plan: ReplicaPlan) -> bool:
        return True

    def problems(self) -> List[Problem]:
        return [p for p in (cuda_problem(),) if p is not None]

    def run_environ(self, environ: Mapping[str, str],
                    free_port: Callable[[], int]) -> Dict[str, str]:
        return {}  # (the launcher's MASTER_ADDR and MASTER_PORT of the run, or host 0's)

    def cluster_replicas(self, host: Mapping[str, Any]) -> Optional[int]:
        return host["replicas"]

    def check_cluster(self, hosts, launch) -> None:
        if any(d["device"] == "TPU" for d in hosts):
            raise OptionError("--runtime torch on TPU hosts needs TorchTPU, which colab_xla "
                              "does not drive yet: use the default runtime (torch_xla).")

    def cluster_environ(self, coordinator: Callable[[], str]) -> Dict[str, str]:
        return {MASTER: coordinator()}  # every host's processes are one job

    # -- the replica's half -----------------------------------------------------------

    def start_process(self, process, job) -> None:
        join(run=job.run_id)

    def device(self) -> Any:
        return device()

    def before_cell(self) -> None:
        initialize()

    def after_process(self) -> None:
        leave()

    def to_host(self, value: Any) -> Any:
        return to_host(value)


RUNTIME = Torch()
