"""PyTorch's own distributed processes (``%%xla_spawn --runtime torch``): the cell runs in N
processes with torchrun's variables and the default process group initialized before it,
as a script that torchrun starts: on CPU with gloo (workshops, laptops), on CUDA GPUs with
NCCL (one process per GPU), on a TPU host with TorchTPU (``torch_tpu``, torch_xla's
successor: one process per chip, backend ``tpu_dist``).

Both halves of the runtime live here (:class:`Torch`), IPython-free:

* the notebook's: :func:`plan` (the processes and their device), :func:`tpu_launch_environ`
  (on a TPU host, the variables TorchTPU's own ``set_tpu_launch_env`` gives a run, computed
  by it in a child process), and the guard that refuses a notebook whose own process opened
  the device (CUDA initialized, or the TPU claimed through torch_tpu): forked children
  cannot use it;
* the replica's: :func:`join` (torchrun's variables, from the rank the launcher gave the
  process, and on a cluster from its host's), :func:`initialize` (the default process
  group, once per process, before its first cell) and :func:`to_host` (tensors to CPU).

A cell written as a torchrun script runs unchanged: its
``dist.init_process_group(...)`` finds the group made and returns (a backend other than the
group's is refused, naming both), and its ``dist.destroy_process_group()`` of the default
group is put off to the process's end, so a session's next cell still has it. The same
holds for the script split across cells, its ``from torch.distributed import
init_process_group, destroy_process_group`` run in an earlier cell of the notebook.

The store where the processes meet is out of other users' reach (a TCP store has no
authentication, and torch's listens on every interface): on one host a ``FileStore`` in the
run's private directory, with gloo's and NCCL's connections on the loopback interface (out
of other machines' reach); across a cluster's hosts rank 0's TCP store, bound to host 0's
address alone, its keys under a secret of the run's.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.util
import os
import re
import secrets
import socket
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..errors import OptionError, Problem, SetupError
from ..wire.host_rank import HostRank
from .base import VARIABLE, Runtime, refuse_xmp_launch
from .gloo_collectives import file_store
from .plan import Hardware, ReplicaCountError, ReplicaPlan
from .torch_xla import DEFAULT_CPU_REPLICAS

# The process group's backend on each device.
BACKENDS = {"CPU": "gloo", "CUDA": "nccl", "TPU": "tpu_dist"}
# Where a run's processes meet (``address:port``): host 0's on a cluster; else the
# launcher's MASTER_ADDR and MASTER_PORT of the run.
MASTER = "COLAB_XLA_TORCH_MASTER"
# The device of a run, as the plan chose it ("CPU", "CUDA"): the replicas' backend.
DEVICE = "COLAB_XLA_TORCH_DEVICE"
# A secret of a cluster's run (or session), the same on every host: the key prefix of its
# TCP store, which anyone who can reach host 0's address can connect to.
STORE_SECRET = "COLAB_XLA_TORCH_STORE_SECRET"
# The store of a run on one host: this file of its private directory.
STORE_FILE = "torch.store"
# The variables that name the interface gloo's and NCCL's sockets use (unset: the
# interface of the machine's hostname); set to loopback on one host.
SOCKET_INTERFACES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# More processes than this on CPU only slow the machine down (each is an interpreter).
MAX_CPU_PROCESSES = 16
# How long a collective waits for a peer before it raises (torch's default: 30 min for
# gloo, 10 for NCCL): a rank that failed leaves the others waiting, and the run is stopped
# by colab_xla before this in any case; a session's replica gets its error instead of a hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)

# The code of the preflight problem "the notebook's process opened the device" (CUDA
# initialized, or the TPU claimed through torch_tpu) is.
DEVICE_OPENED = "torch-device-opened"
# Calls that open a GPU or a TPU in the process that makes them: a tensor made on or moved
# to it, torch.cuda's initializing calls, and a TPU process group (torch_tpu 0.2.0 claims
# the chips at the first TPU tensor or init_process_group("tpu_dist"); importing it, or
# torch.device("tpu"), does not).
STARTING_CALLS = re.compile(
    r"(\.(?:cuda|tpu)\(|\.to\(['\"](?:cuda|tpu)|device\s*=\s*['\"](?:cuda|tpu)|"
    r"torch\.cuda\.(?:init|set_device|current_device|synchronize|mem_get_info|"
    r"get_device_properties|manual_seed)\(|torch\.tpu\.(?:synchronize|manual_seed)\(|"
    r"init_process_group\(\s*(?:backend\s*=\s*)?['\"]tpu|"
    r"torch\.zeros\([^)]*(?:cuda|tpu)|torch\.(?:ones|randn|rand|empty|tensor)\([^)]*(?:cuda|tpu))")

TORCH_INSTALL_HINT = "pip install torch, then restart the kernel."
TORCH_TPU_INSTALL_HINT = ("pip install torch-tpu (TorchTPU: it brings the torch and libtpu it "
                          "needs), then restart the kernel")
# How long TorchTPU's launch code may take in its child process (an import of torch and
# torch_tpu: seconds).
LAUNCH_ENV_SECONDS = 120


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
        return _tpu_plan(requested, hw)
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


def _tpu_plan(requested: Optional[int], hw: Hardware) -> ReplicaPlan:
    """One process per chip, driven by TorchTPU (their launch variables:
    :func:`tpu_launch_environ`, per run)."""
    if importlib.util.find_spec("torch_tpu") is None:
        raise ReplicaCountError(
            f"--runtime torch on a TPU host needs TorchTPU (torch_tpu), which is not "
            f"installed: {TORCH_TPU_INSTALL_HINT}; or use the default runtime (torch_xla), "
            "or --env PJRT_DEVICE=CPU for gloo processes on the CPU.")
    chips = hw.tpu_chips
    n = requested or chips
    if chips and n > chips:
        raise ReplicaCountError(f"-n {n}: this host has {chips} TPU chip"
                                f"{'s' if chips != 1 else ''}, one TorchTPU process each; use "
                                f"-n {chips} or fewer.")
    env: Dict[str, Optional[str]] = {VARIABLE: RUNTIME.name, DEVICE: "TPU"}
    note = (f"colab_xla: torch runtime, {n} process{'es' if n != 1 else ''}, one per TPU "
            "chip (TorchTPU, tpu_dist).")
    return ReplicaPlan("TPU", n, env, note, processes=n, runtime=RUNTIME)


def tpu_launch_environ(environ: Mapping[str, str], processes: int,
                       python: str = sys.executable) -> Dict[str, str]:
    """The variables TorchTPU's ``torch.tpu.distributed.set_tpu_launch_env`` adds for a run
    of ``processes`` processes on this host (the replicas' environment being ``environ``):
    what it computes (the slice builders' addresses, the topology, the profiling session),
    computed by it, in a child process (it writes ``os.environ``, memoizes what it read, and
    on a multi-host slice may query the chips' coordinates, which claims them).

    What colab_xla knows is given to it first, and it never overwrites a variable: on a
    cluster's host (:class:`~colab_xla.wire.host_rank.HostRank`) the hosts
    (``TPU_WORKER_HOSTNAMES``, from :meth:`Torch.cluster_environ`), ``NODE_RANK`` (so that
    it starts no child to read coordinates), ``NNODES``, the processes per host, and host
    0's ``MASTER_ADDR``/``MASTER_PORT``; a slice's ``TPU_TOPOLOGY`` (GKE's) as its
    ``TORCH_TPU_TOPOLOGY``. Raises :class:`colab_xla.errors.SetupError` with its error."""
    import json
    import subprocess

    host = HostRank.from_environ(environ)
    given: Dict[str, str] = {}
    if host is not None and host.hosts > 1:
        given.update(NNODES=str(host.hosts), NODE_RANK=str(host.host),
                     TORCH_TPU_DEVICES_PER_HOST=str(processes))
        master = environ.get(MASTER)
        if master:
            given["MASTER_ADDR"], given["MASTER_PORT"] = master.rsplit(":", 1)
    if environ.get("TPU_TOPOLOGY") and not environ.get("TORCH_TPU_TOPOLOGY"):
        given["TORCH_TPU_TOPOLOGY"] = slice_topology(environ["TPU_TOPOLOGY"])
    child = {**environ, **given}
    child.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    code = ("import json, os, sys\n"
            "before = dict(os.environ)\n"
            "from torch_tpu._internal.distributed.distributed import set_tpu_launch_env\n"
            "sys.argv = sys.argv[:1]\n"  # (it parses absl flags from sys.argv)
            f"set_tpu_launch_env(nnodes={host.hosts if host else 1}, "
            f"nproc_per_node={processes})\n"
            "print('COLAB_XLA_TPU_LAUNCH=' + json.dumps({k: v for k, v in os.environ.items()"
            " if before.get(k) != v}))\n")
    try:
        done = subprocess.run([python, "-c", code], env=child, capture_output=True,
                              text=True, timeout=LAUNCH_ENV_SECONDS)
    except subprocess.TimeoutExpired:
        raise SetupError(f"TorchTPU's set_tpu_launch_env did not answer within "
                         f"{LAUNCH_ENV_SECONDS} s.") from None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("COLAB_XLA_TPU_LAUNCH="):
            return {**given, **json.loads(line.partition("=")[2])}
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    raise SetupError("TorchTPU's set_tpu_launch_env failed"
                     + (f": {lines[-1].strip()}" if lines else f" (exit code {done.returncode})."))


def slice_topology(topology: str) -> str:
    """GKE's ``TPU_TOPOLOGY`` (``"2x4"``, ``"4x4x4"``) as TorchTPU's native runtime reads
    ``TORCH_TPU_TOPOLOGY``: three comma-separated bounds (``"2,4,1"``; it refuses ``"2x4"``:
    "Incorrect number of elements specified for TPU dimensions").

    >>> slice_topology("2x4"), slice_topology("4x4x4")
    ('2,4,1', '4,4,4')
    """
    bounds = [b for b in re.split(r"[,xX]", topology.strip()) if b]
    return ",".join(bounds + ["1"] * (3 - len(bounds)))


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
        DEVICE_OPENED,
        "CUDA is initialized in this notebook's own process (a tensor moved to a GPU, or a "
        "torch.cuda call, ran outside %%xla_spawn), so the processes forked from it cannot "
        "use CUDA.",
        "restart the kernel, then use the GPUs only inside %%xla_spawn --runtime torch cells "
        "(where `device` is each process's GPU).")


def tpu_problem() -> Optional[Problem]:
    """A :class:`colab_xla.errors.Problem` if this process (the notebook's) claimed the TPU
    through torch_tpu, else None: the chips are then held until the kernel restarts, and a
    forked child may not touch them ("cannot access or re-initialize TPU in a forked
    subprocess"). Asks torch_tpu's device backend (its native ``_is_initialized``, which
    the first TPU tensor and a ``tpu_dist`` process group set); never imports it."""
    backend = sys.modules.get("torch_tpu._internal.device._device_ops_backend")
    if backend is None or not (backend._is_initialized() or backend._is_in_bad_fork()):
        return None
    return Problem(
        DEVICE_OPENED,
        "The TPU is claimed by this notebook's own process (a tensor made on or moved to "
        "the TPU, or a tpu_dist process group, ran outside %%xla_spawn), so TorchTPU's "
        "processes cannot open the chips (\"Device or resource busy\").",
        "restart the kernel, then use the TPU only inside %%xla_spawn --runtime torch cells "
        "(where `device` is each process's chip); importing torch_tpu in the notebook is "
        "fine.")


def doctor_facts(hw: Hardware, environ: Mapping[str, str],
                 installed: Callable[[str], Optional[str]]) -> List[Tuple[str, str]]:
    """``%xla_doctor``'s line of this runtime: what ``--runtime torch`` would start here
    (TorchTPU's version and the chips, or the GPUs, or gloo on CPU), and whether this
    notebook's process holds the device (``installed(package)``: its version, or None).
    Reads package metadata and the PCI bus only."""
    if installed("torch") is None:
        return [("--runtime torch", f"PyTorch not installed ({TORCH_INSTALL_HINT})")]
    tpu = installed("torch-tpu")
    packages = f"torch {installed('torch')}" + (
        f", TorchTPU {tpu} (libtpu {installed('libtpu') or 'not installed'})" if tpu else "")
    try:
        start = plan(None, hw, environ).note.removeprefix("colab_xla: torch runtime, ")
    except ReplicaCountError as exc:
        start = str(exc)
    held = [p.message for p in (cuda_problem(), tpu_problem()) if p is not None]
    return [("--runtime torch", f"{packages}; {start}"),
            ("  its device", held[0] if held else "not opened by this notebook (good)")]


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


def loopback_interface() -> Optional[str]:
    """The name of this machine's loopback interface (Linux's ``lo``), or None."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return "lo" if "lo" in names else None


def listening_store(address: str, port: int, world: Optional[int] = None, *,
                    timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
                    wait_for_workers: bool = True):
    """A ``TCPStore`` served by this process that listens on ``address`` alone (``port``
    0: any free port): torch's own master listens on every interface, whatever host it is
    given, so it is given a socket bound here (``master_listen_fd``; the store owns it)."""
    import torch.distributed as dist

    family, kind, proto, _, where = socket.getaddrinfo(address, port,
                                                       type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    fd = listener.detach()
    try:
        return dist.TCPStore(address, port, world, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


_initialized = False
_membership: Dict[str, str] = {}  # torchrun's variables of this process (join)
_run_name = "colab_xla"  # the run (or session) the process serves: its store's key prefix
_secret = ""  # a cluster run's STORE_SECRET (join)
_store_path: Optional[str] = None  # on one host, the FileStore's (join)
_store: List[Any] = []  # the process group's store, kept as long as the group


def join(environ: Mapping[str, str] = os.environ, run: str = "colab_xla",
         directory: Optional[str] = None, names: Optional[Dict[str, Any]] = None,
         bindings=None) -> None:
    """In a new replica process: keep torchrun's variables, as the launcher's rank gives
    them (a session's later cells bring an environment without them: each cell gets them
    again, :func:`initialize`), and make the process group's calls fit for a cell written
    as a torchrun script (:func:`_fit_script_calls`), ``names`` being the notebook's names
    as the process has them (``bindings``: where names were bound before the fork).
    ``directory``: the run's (or session's) private directory, where the processes of one
    host meet; on one host gloo's and NCCL's sockets are put on
    the loopback interface, unless the environment names one."""
    global _run_name, _secret, _store_path
    _membership.update(torchrun_environ(environ))
    host = HostRank.from_environ(environ)
    _run_name = host.run if host and host.run else run  # (every host's: the same)
    _secret = environ.get(STORE_SECRET, "")
    if environ is os.environ:
        os.environ.pop(STORE_SECRET, None)  # (the cell's code and children need it not)
    one_host = host is None or host.hosts == 1
    _store_path = os.path.join(directory, STORE_FILE) if one_host and directory else None
    loopback = loopback_interface() if one_host else None
    if loopback:
        _membership.update({name: loopback for name in SOCKET_INTERFACES
                            if not environ.get(name)})
    _fit_script_calls({} if names is None else names, bindings)


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
    rank, world = int(_membership["RANK"]), int(_membership["WORLD_SIZE"])
    store = _meeting_store(rank, world)
    _store[:] = [store]
    # (its keys under this run's name, and a cluster run's secret: another run that got
    # the same free port, two notebooks or two test workers, cannot mix its ranks in)
    prefix = "/".join(["colab_xla"] + ([_secret] if _secret else []) + [_run_name])
    with _gloo_banner_hidden(), _init_barrier():
        _real["init"](backend(), store=dist.PrefixStore(prefix, store),
                      rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    _initialized = dist.is_initialized()


def _meeting_store(rank: int, world: int):
    """Where the processes meet: on one host a ``FileStore`` in the run's private directory
    (nothing listens); across hosts the TCP store at ``MASTER_ADDR:MASTER_PORT``, served by
    rank 0 on that address alone (:func:`listening_store`)."""
    import torch.distributed as dist

    if _store_path is not None:
        return file_store(_store_path, world)  # (0600, as the simulation's)
    address, port = _membership["MASTER_ADDR"], int(_membership["MASTER_PORT"])
    if rank == 0:
        return listening_store(address, port, world)
    return dist.TCPStore(address, port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)


@contextlib.contextmanager
def _init_barrier():
    """The group is made on every rank before any rank goes on (torch's own store-based
    barrier after the group, off by default since torch 2.1). Without it, a rank that made
    its side of gloo's connections first could end its trivial cell and close them while
    another rank still read its handshake there, which failed with "Gloo connectFullMesh
    failed ... Connection closed by peer" (seen in this project's tests, and with bare
    torch processes that exit right after init_process_group)."""
    saved = os.environ.get("TORCH_DIST_INIT_BARRIER")
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCH_DIST_INIT_BARRIER", None)
        else:
            os.environ["TORCH_DIST_INIT_BARRIER"] = saved


@contextlib.contextmanager
def _gloo_banner_hidden():
    """Gloo writes "[Gloo] Rank R is connected to N peer ranks. Expected number of connected
    peer ranks is : N" to C's stdout as it makes a group (torch 2.9-2.11): plumbing, not
    the cell's output, and it would end every process's output (stdout to a pipe is
    flushed at exit). While the group is made, C's stdout goes nowhere and is flushed
    there; Python's own stdout is untouched."""
    if backend() != "gloo":
        yield
        return
    import ctypes

    libc = ctypes.CDLL(None)
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def leave() -> None:
    """At the end of the process: the default process group goes."""
    global _initialized
    if _initialized:
        _real["destroy"]()
        _initialized = False
        _store.clear()


def device():
    """The cell's ``device``: this process's GPU or TPU chip, or the CPU."""
    import torch

    kind = os.environ.get(DEVICE)
    if kind == "CUDA":
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if kind == "TPU":
        return torch.device("tpu")  # (each process sees its chip as tpu:0)
    return torch.device("cpu")


_real: Dict[str, Callable] = {}
# Backend names a script may give for the backend colab_xla made ("tpu": TorchTPU's alias).
_ALIASES = {"tpu": "tpu_dist"}


def _fit_script_calls(names: Dict[str, Any], bindings=None) -> None:
    """``dist.init_process_group`` returns if the default group exists with that backend
    (another backend is refused, naming both), and ``dist.destroy_process_group()`` of the
    default group waits for the process's end (:func:`leave`): under every name bound to
    torch's own functions, ``torch.distributed``'s and those bound before (``from
    torch.distributed import init_process_group`` in the notebook, ``names`` its names as
    the process has them: :func:`colab_xla.runtimes.bound_names.rebind`)."""
    import torch.distributed as dist

    from .bound_names import rebind

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

    # Every name for them rebound (torch.distributed's, distributed_c10d's where a serialized
    # reference is looked up, the notebook's), not torch's functions patched to defer:
    # those stay torch's own code, which makes and ends colab_xla's group (initialize, leave).
    rebind({_real["init"]: init_process_group, _real["destroy"]: destroy_process_group}, names,
           bindings)


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
    started_code = DEVICE_OPENED
    starting_calls = STARTING_CALLS
    preloads = ("torch.distributed",)  # (not torch_xla)
    replaces = ("torch.distributed",)

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

    def doctor_facts(self, hardware: Hardware, environ: Mapping[str, str],
                     version: Callable[[str], Optional[str]]) -> List[Tuple[str, str]]:
        return doctor_facts(hardware, environ, version)

    def problems(self) -> List[Problem]:
        return [p for p in (cuda_problem(), tpu_problem()) if p is not None]

    def run_environ(self, environ: Mapping[str, str], free_port: Callable[[], int],
                    unix_socket: Optional[Callable[[str], Optional[str]]] = None
                    ) -> Dict[str, str]:
        # (the launcher's MASTER_ADDR and MASTER_PORT of the run, or host 0's; on a TPU
        # host, what TorchTPU's launch code adds for this run's processes)
        if environ.get(DEVICE) != "TPU":
            return {}
        return tpu_launch_environ(environ, int(environ["PJRT_LOCAL_PROCESS_COUNT"]))

    def cluster_replicas(self, host: Mapping[str, Any]) -> Optional[int]:
        return host["replicas"]

    def check_cluster(self, hosts, launch) -> None:
        pass  # (each host plans its own: TorchTPU's absence is its host's error)

    def cluster_environ(self, hosts, coordinator: Callable[[], str]) -> Dict[str, str]:
        # Every host's processes are one job, host 0 its master, its store's keys under a
        # secret of the run's; TPU hosts are TorchTPU's TPU_WORKER_HOSTNAMES, in host
        # order (NODE_RANK: tpu_launch_environ).
        environ = {MASTER: coordinator(), STORE_SECRET: secrets.token_hex(16)}
        if any(d["device"] == "TPU" for d in hosts):
            environ["TPU_WORKER_HOSTNAMES"] = ",".join(d["address"] for d in hosts)
        return environ

    # -- the replica's half -----------------------------------------------------------

    def start_process(self, process, job) -> None:
        join(run=job.run_id, directory=job.run_dir, names=process.user_ns,
             bindings=process.bindings)

    def device(self) -> Any:
        return device()

    def before_cell(self) -> None:
        initialize()

    def after_process(self) -> None:
        leave()

    def to_host(self, value: Any) -> Any:
        return to_host(value)


RUNTIME = Torch()
