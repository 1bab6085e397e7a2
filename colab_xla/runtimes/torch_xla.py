"""The torch_xla runtime (the default): the cell runs on every XLA replica, which xmp.spawn
(or ``torch_xla.launch``) starts; on CPU, on N simulated replicas of a TPU host
(:mod:`colab_xla.runtimes.simulation`), as one process each that colab_xla starts itself,
or as threads of one process.

* The notebook's half: :func:`plan_replicas`, a pure function of what
  :func:`colab_xla.notebook.hardware.detect` found, so every rule is testable without
  hardware; and the refusal of a notebook whose own process initialized the XLA
  runtime (:func:`runtime_initialized`).
* The replica's half: torch_xla instrumented in each replica process, its compilation
  cache, the CPU simulation's collectives (:mod:`colab_xla.runtimes.torch_xla_process`),
  and ``device``, ``torch_xla.device()`` on first use.

Example::

    >>> plan = plan_replicas(4, Hardware(pjrt_device=None, tpu_chips=0))
    >>> plan.device_type, plan.replicas, plan.env["CPU_NUM_DEVICES"]
    ('CPU', 4, '1')
"""

from __future__ import annotations

import importlib.util
import re
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..errors import OptionError, Problem, SetupError
from . import runtime_clients, torch_xla_process
from ..wire.host_rank import HostRank
from .base import Runtime, meeting_place
from .plan import DEVICE_FILES, DeviceMissing, Hardware, ReplicaCountError, ReplicaPlan
from .simulation import DEFAULT_SIMULATION, environment as simulated_environment

# A simulated host has as many replicas as a TPU v2-8/v3-8 host, so notebooks written for
# Colab's TPU run unchanged on a laptop.
DEFAULT_CPU_REPLICAS = 8
# One process runs every simulated replica as a thread. Beyond 128 (seen on torch_xla 2.9),
# XLA's CPU collectives abort the process: "Expected 129 threads to join the rendezvous,
# but only 128 of them arrived on time", after a 10 s wait. -n 1000000 is a typo besides.
MAX_CPU_REPLICAS = 128

RUNTIME_INITIALIZED = (
    "The XLA runtime is already initialized in this notebook's own process, so replicas cannot "
    "be started: xmp.spawn refuses, and a replica forked from this process would hang. An "
    "earlier cell called one of torch_xla.device(), xm.xla_device(), xr.world_size(), "
    "xr.global_ordinal(), xr.addressable_device_count(), or moved a tensor to an XLA device.")
RUNTIME_INITIALIZED_FIX = (
    "restart the runtime (Runtime > Restart session, or Kernel > Restart), then use the XLA "
    "device only inside %%xla_spawn cells, where `device` is each replica's device.")
# The code of the preflight problem an initialized XLA runtime in the notebook's process is.
INITIALIZED = "runtime-initialized"
# Calls that initialize the XLA runtime in the process that makes them.
STARTING_CALLS = re.compile(
    r"(torch_xla\.device\(|xla_device\(|xr\.world_size\(|xr\.global_ordinal\(|"
    r"world_size\(\)|global_ordinal\(\)|addressable_device_count\(|"
    r"device\s*=\s*['\"]xla|\.to\(['\"]xla|xmp\.spawn\([^)]*nprocs\s*=\s*1)")

TORCH_XLA_INSTALL_HINT = (
    "On a Colab or Kaggle TPU runtime it comes preinstalled: check that the runtime type is "
    "TPU. Elsewhere: pip install torch torch_xla (the two versions must match, e.g. both "
    "2.9.0), then restart the kernel.")
TORCH_XLA_MISSING = ("torch_xla is not installed in this kernel's environment, and "
                     "%%xla_spawn runs on it. " + TORCH_XLA_INSTALL_HINT)


class TorchXlaMissing(SetupError, ImportError):
    """torch_xla cannot be imported (the message says how to install it)."""


class UnsupportedTpuError(ReplicaCountError):
    """This torch_xla does not know the TPU chips on the PCI bus, so xmp.spawn would start
    no replica (``ValueError: max_workers must be greater than 0``)."""


# The topology of one process on one chip, as torch_xla sets it itself for a one-chip run
# (torch_xla/_internal/tpu.py, configure_one_chip_topology, used by xmp.spawn(nprocs=1)).
# xmp.spawn(nprocs=None) calls configure_topology instead, which multiplies the host's
# process bounds by its chips per process: from TPU_HOST_BOUNDS=1,1,1 and
# TPU_CHIPS_PER_HOST_BOUNDS=2,2,1, seen on Colab's one-chip v5e-1 (tests/tpu_hosts), it
# makes TPU_PROCESS_BOUNDS=2,2,1 -- four processes -- for the one process and one address
# xmp.spawn starts there: libtpu's "Expected 4 worker addresses, got 1". torch_xla keeps a
# value already set (os.environ.setdefault), so these reach its libtpu unchanged.
ONE_CHIP_TOPOLOGY = {"TPU_VISIBLE_CHIPS": "0", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
                     "TPU_PROCESS_BOUNDS": "1,1,1"}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _device_missing(device: str, pjrt_device: str) -> str:
    what = {"TPU": "TPU (no TPU chip on its PCI bus, no /dev/accel* or /dev/vfio device)",
            "CUDA": "NVIDIA GPU (no /dev/nvidia0)", "GPU": "NVIDIA GPU (no /dev/nvidia0)"}
    runtime = ("On Colab or Kaggle, change the runtime type to TPU. "
               if device == "TPU" else "")
    return (f"PJRT_DEVICE={pjrt_device}, but this machine has no {what[device]}, so no "
            f"replica could start. {runtime}To run on CPU replicas here, unset it "
            "(os.environ.pop('PJRT_DEVICE') in a cell, and no --env PJRT_DEVICE=...) or set "
            "PJRT_DEVICE=CPU.")


def _tpu_count_message(requested: int, hw: Hardware, total: Optional[int]) -> str:
    """Short: what this host runs, and the two ways to run a notebook written for -n N."""
    chips = _plural(hw.tpu_chips, f"TPU {hw.tpu_generation} chip" if hw.tpu_generation
                    else "TPU chip")
    if total:
        cores = f" of {hw.tpu_cores_per_chip} cores" if hw.tpu_cores_per_chip != 1 else ""
        has = f"this host has {chips}{cores}, so it runs {_plural(total, 'replica')}"
    else:
        has = (f"this host has {chips}, and how many replicas xmp.spawn runs on them could "
               "not be read (it runs one per TPU core)")
    return (f"-n {requested}: {has}. Leave -n out to run here, or simulate {requested} "
            "replicas on CPU: os.environ['PJRT_DEVICE'] = 'CPU' in a cell before.")


def _unsupported_tpu(hw: Hardware) -> str:
    try:
        from importlib.metadata import version
        which = f"torch_xla {version('torch_xla')}"
    except Exception:  # noqa: BLE001 - only for the message
        which = "this torch_xla"
    chips = _plural(hw.tpu_chips, f"TPU {hw.tpu_generation or ''} chip".replace("  ", " "))
    newer = " (2.9 or later)" if hw.tpu_generation == "7x" else ""
    return (f"this host has {chips}, which {which} does not know, so xmp.spawn would start "
            f"no replica. Install a torch_xla that supports them{newer}, then restart the "
            "runtime; or simulate replicas on CPU: os.environ['PJRT_DEVICE'] = 'CPU' in a "
            "cell before.")


def plan_replicas(requested: Optional[int], hw: Hardware,
                  simulation: str = DEFAULT_SIMULATION) -> ReplicaPlan:
    """Decide device and replica count, or raise :class:`ReplicaCountError`.

    On CPU any N >= 1 works: N processes of one CPU device each (``simulation``
    "processes"), or N CPU devices of one process (``CPU_NUM_DEVICES``, "threads"). A TPU
    host always runs every local TPU core (xmp.spawn accepts no other count). Other PJRT
    devices run xmp.spawn's default.
    """
    if requested is not None and requested < 1:
        raise ReplicaCountError(f"-n {requested}: the number of replicas must be 1 or more.")
    device = hw.device

    if device == "CPU":
        if requested is None and hw.bad_cpu_num_devices is not None:
            raise ReplicaCountError(
                f"CPU_NUM_DEVICES={hw.bad_cpu_num_devices!r}: the number of replicas to "
                "simulate on CPU must be a whole number, 1 or more. Set one "
                "(os.environ['CPU_NUM_DEVICES'] = '4'), remove it for the default "
                f"{DEFAULT_CPU_REPLICAS} (del os.environ['CPU_NUM_DEVICES']), or give -n 4, "
                "which takes its place.")
        n = requested or hw.cpu_num_devices or DEFAULT_CPU_REPLICAS
        if n > MAX_CPU_REPLICAS:
            given = f"-n {n}" if requested else f"CPU_NUM_DEVICES={n}"
            why = (f"each is a process of its own: starting {MAX_CPU_REPLICAS} already takes "
                   "seconds" if simulation == "processes" else
                   f"XLA's CPU collectives abort beyond that: only {MAX_CPU_REPLICAS} "
                   "replicas reach them")
            raise ReplicaCountError(
                f"{given}: at most {MAX_CPU_REPLICAS} replicas can be simulated on CPU ({why}); "
                f"ask for {MAX_CPU_REPLICAS} or fewer.")
        processes = n if simulation == "processes" else 1
        note = None
        if hw.pjrt_device is None:
            how = ("one process each, like a TPU v4 or later host" if processes > 1 else
                   "threads of one process, like a TPU v2/v3 host" if n > 1 else "one process")
            note = (f"colab_xla: no TPU found, running {_plural(n, 'replica')} on CPU ({how}; "
                    "--simulate processes|threads chooses).")
        env = simulated_environment(n, simulation=simulation,
                                    thread_pool_set=hw.xla_thread_pool_size is not None,
                                    param_aliasing_set=hw.param_aliasing is not None)
        return ReplicaPlan("CPU", n, env, note, processes=processes, simulation=simulation,
                           runtime=RUNTIME)

    if device in DEVICE_FILES and hw.pjrt_device and not hw.tpu_chips and not hw.device_files:
        raise DeviceMissing(_device_missing(device, hw.pjrt_device))

    if device == "TPU":
        if hw.tpu_chips and hw.torch_xla_tpu_chips is not None \
                and hw.torch_xla_tpu_chips < hw.tpu_chips:
            raise UnsupportedTpuError(_unsupported_tpu(hw))
        total = hw.tpu_chips * hw.tpu_cores_per_chip if hw.tpu_cores_per_chip else None
        if requested is not None and requested != total:
            raise ReplicaCountError(_tpu_count_message(requested, hw, total))
        env = {"PJRT_DEVICE": hw.pjrt_device or "TPU"}
        if hw.tpu_chips == 1:
            env.update(ONE_CHIP_TOPOLOGY)
        return ReplicaPlan("TPU", total, env, processes=hw.tpu_chips, runtime=RUNTIME)

    if requested is not None:
        raise ReplicaCountError(
            f"-n {requested}: on PJRT_DEVICE={hw.pjrt_device} the replica count is set by "
            f"that device's own variable ({device}_NUM_DEVICES); leave -n out.")
    return ReplicaPlan(device, None, {"PJRT_DEVICE": hw.pjrt_device}, runtime=RUNTIME)


def runtime_initialized() -> bool:
    """True if this process already initialized the XLA runtime (never initializes it)."""
    torch_xla = sys.modules.get("torch_xla")
    return bool(torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized())


class TorchXla(Runtime):
    """XLA replicas (:mod:`colab_xla.runtimes.torch_xla`)."""

    name = "torch_xla"
    started_code = INITIALIZED
    starting_calls = STARTING_CALLS
    replaces = torch_xla_process.REPLACED_IN
    # (the simulation's operator, its collectives between processes, Dynamo's openxla
    # backend, which threads refuse)
    simulation_preloads = ("colab_xla.runtimes.collective_op",
                           "colab_xla.runtimes.shm_collectives",
                           "torch._dynamo.backends.torchxla")

    # -- the notebook's half ----------------------------------------------------------

    def check_installed(self) -> None:
        # (colab_xla.notebook.torch_xla_import imports it, for the launcher, before start)
        if importlib.util.find_spec("torch_xla") is None:
            raise TorchXlaMissing(TORCH_XLA_MISSING)

    def check_launch(self, launch) -> None:
        if launch.devices_per_process is not None:
            raise OptionError("--devices-per-process is for --runtime jax (torch_xla's "
                              "replicas have one device each).")

    def plan(self, requested: Optional[int], hardware: Hardware, *,
             simulate: Optional[str] = None, devices_per_process: Optional[int] = None,
             environ: Optional[Mapping[str, str]] = None) -> ReplicaPlan:
        return plan_replicas(requested, hardware, simulate or DEFAULT_SIMULATION)

    def own_processes(self, plan: ReplicaPlan) -> bool:
        # xmp.spawn runs one CPU process whatever the count: the simulation's are ours.
        return plan.simulation == "processes"

    def problems(self) -> List[Problem]:
        if runtime_initialized():
            return [Problem(INITIALIZED, RUNTIME_INITIALIZED, RUNTIME_INITIALIZED_FIX)]
        return []

    def run_environ(self, environ: Mapping[str, str], free_port: Callable[[], int],
                    unix_socket: Optional[Callable[[str], Optional[str]]] = None
                    ) -> Dict[str, str]:
        # (each process's rank is the launcher's, as xmp.spawn tells its own.) On a CPU,
        # where the replicas' own init_process_group meets; a TPU, or a cluster's host
        # (HostRank), finds its own.
        if environ.get("PJRT_DEVICE") != "CPU" or HostRank.from_environ(environ):
            return {}
        return meeting_place(environ, free_port)

    def cluster_replicas(self, host: Mapping[str, Any]) -> Optional[int]:
        return host["replicas"]

    def check_cluster(self, hosts, launch) -> None:
        return None

    def cluster_environ(self, hosts, coordinator: Callable[[], str]) -> Dict[str, str]:
        return {}  # (the hosts' replicas meet through host 0's store: HostRank)

    # -- the replica's half -----------------------------------------------------------

    def start_process(self, process, job) -> None:
        if job.cache_dir:
            torch_xla_process.initialize_cache(job.cache_dir, process.rank)
        torch_xla_process.instrument(process, job.run_dir)

    def device(self) -> Any:
        import torch_xla

        runtime_clients.before_torch_xla()
        device = torch_xla.device()
        runtime_clients.notice_torch_xla()  # from now on, a JAX backend skips discovery
        return device

    def before_cell(self) -> None:
        return None

    def after_process(self) -> None:
        return None

    def to_host(self, value: Any) -> Any:
        return value  # (XLA tensors become CPU tensors as the value is pickled)


RUNTIME = TorchXla()
