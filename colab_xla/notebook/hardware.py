"""Which device the replicas run on and how many there are, without initializing XLA.

The notebook's own process must never initialize the XLA runtime (xmp.spawn refuses to
start afterwards, and a forked replica of an initialized process hangs). Everything here
reads environment variables and the PCI bus only; the TPU metadata server is asked only
when neither says which TPU this is, and never for longer than :data:`METADATA_TIMEOUT`.

:func:`plan_replicas` is a pure function of what :func:`detect` found, so every rule is
testable without hardware::

    >>> plan = plan_replicas(4, Hardware(pjrt_device=None, tpu_chips=0))
    >>> plan.device_type, plan.replicas, plan.env["CPU_NUM_DEVICES"]
    ('CPU', 4, '4')
"""

from __future__ import annotations

import functools
import glob
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from .simulation import DEFAULT_SIMULATION, environment as simulated_environment
from . import interrupts
from ..errors import SetupError

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


# Google's PCI vendor id and the device ids of its TPU chips, with the generation and the
# replicas xmp.spawn runs per chip (one thread per device of the chip's process). colab_xla
# keeps its own table: torch_xla 2.8's (torch_xla/_internal/tpu.py, _TPU_PCI_DEVICE_IDS)
# lacks 7x, which 2.9 added (pytorch/xla#9586). Devices per chip: 2 on v2/v3 (torch_xla's
# num_logical_cores_per_chip); 1 on v4/v5p (megacore), v5e and v6e. 7x chips have two
# TensorCores and torch_xla 2.9 gives 7x a fourth process-bound dimension of 2
# (configure_topology); whether a process then runs 1 or 2 replicas is not known without a
# 7x host, so the count is left to xmp.spawn (None).
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = {
    "0x0027": ("v2/v3", 2),
    "0x005e": ("v4", 1),
    "0x0063": ("v5e", 1),
    "0x006f": ("v6e", 1),
    "0x0076": ("7x", None),
    "0x0062": (None, None),  # torch_xla: "testing only"; generation from the accelerator type
    "0x0056": (None, None),
}
PCI_DEVICES_GLOB = "/sys/bus/pci/devices/*/vendor"
METADATA_TIMEOUT = 2.0  # seconds: torch_xla's own metadata query has no timeout


class ReplicaCountError(SetupError, ValueError):
    """The hardware cannot run the number of replicas asked for (the message says why)."""


class DeviceMissing(ReplicaCountError):
    """PJRT_DEVICE names an accelerator this machine does not have: no replica can run."""


# Device files each accelerator shows on Linux (TPU v4 and earlier: accel; v5e and later:
# VFIO groups; NVIDIA GPUs).
DEVICE_FILES = {"TPU": ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*"),
                "CUDA": ("/dev/nvidia[0-9]*",), "GPU": ("/dev/nvidia[0-9]*",)}


def _device_missing(device: str, pjrt_device: str) -> str:
    what = {"TPU": "TPU (no TPU chip on its PCI bus, no /dev/accel* or /dev/vfio device)",
            "CUDA": "NVIDIA GPU (no /dev/nvidia0)", "GPU": "NVIDIA GPU (no /dev/nvidia0)"}
    runtime = ("On Colab or Kaggle, change the runtime type to TPU. "
               if device == "TPU" else "")
    return (f"PJRT_DEVICE={pjrt_device}, but this machine has no {what[device]}, so no "
            f"replica could start. {runtime}To run on CPU replicas here, unset it "
            "(os.environ.pop('PJRT_DEVICE') in a cell, and no --env PJRT_DEVICE=...) or set "
            "PJRT_DEVICE=CPU.")


class UnsupportedTpuError(ReplicaCountError):
    """This torch_xla does not know the TPU chips on the PCI bus, so xmp.spawn would start
    no replica (``ValueError: max_workers must be greater than 0``)."""


@dataclass(frozen=True)
class Hardware:
    """What is known without initializing the runtime."""

    pjrt_device: Optional[str]  # PJRT_DEVICE as the user set it, or None
    tpu_chips: int = 0  # TPU chips on the PCI bus
    tpu_cores_per_chip: Optional[int] = None  # 2 on v2/v3, 1 later; None if unknown
    tpu_generation: Optional[str] = None  # "v5e", "7x", ... from the PCI id or accelerator type
    torch_xla_tpu_chips: Optional[int] = None  # chips torch_xla's own PCI table counts
    cpu_num_devices: Optional[int] = None  # CPU_NUM_DEVICES as the user set it
    bad_cpu_num_devices: Optional[str] = None  # CPU_NUM_DEVICES if it is not a count (1 or more)
    xla_thread_pool_size: Optional[str] = None  # XLA_THREAD_POOL_SIZE as the user set it
    param_aliasing: Optional[str] = None  # XLA_ENABLE_PARAM_ALIASING as the user set it
    # Device files of the accelerator PJRT_DEVICE names (/dev/accel0, /dev/nvidia0): a
    # device that none shows, and no PCI chip either, is not on this machine.
    device_files: Tuple[str, ...] = ()

    @property
    def device(self) -> str:
        """The device type replicas run on: PJRT_DEVICE's (``"TPU"`` for ``TPU_C_API``),
        else TPU where the PCI bus shows chips, else CPU."""
        return _device_type(self.pjrt_device or ("TPU" if self.tpu_chips else "CPU"))


def _device_type(pjrt_device: str) -> str:
    return pjrt_device.upper().split("_")[0]


@dataclass(frozen=True)
class ReplicaPlan:
    """How to start the replicas: device type, replica count, environment for them."""

    device_type: str
    replicas: Optional[int]  # None: xmp.spawn's own count (unknown here)
    env: Dict[str, Optional[str]] = field(default_factory=dict)  # None: unset it
    note: Optional[str] = None  # one line to tell the user, or None
    processes: int = 1  # replica processes (one per TPU chip; on CPU, see simulation)
    # On CPU, the model simulated (colab_xla.replica.cpu_sim.SIMULATIONS); None on other devices.
    simulation: Optional[str] = None
    runtime: str = "torch_xla"  # or "jax" (colab_xla.runtimes.jax)

    @property
    def own_processes(self) -> bool:
        """Whether colab_xla starts one process per replica itself: xmp.spawn runs one
        CPU process whatever the count, and JAX processes are never xmp.spawn's."""
        return self.runtime == "jax" or (self.simulation == "processes" and self.processes > 1)


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
        return ReplicaPlan("CPU", n, env, note, processes=processes, simulation=simulation)

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
        return ReplicaPlan("TPU", total, env, processes=hw.tpu_chips)

    if requested is not None:
        raise ReplicaCountError(
            f"-n {requested}: on PJRT_DEVICE={hw.pjrt_device} the replica count is set by "
            f"that device's own variable ({device}_NUM_DEVICES); leave -n out.")
    return ReplicaPlan(device, None, {"PJRT_DEVICE": hw.pjrt_device})


def detect(environ: Mapping[str, str] = os.environ) -> Hardware:
    """Read PJRT_DEVICE, CPU_NUM_DEVICES and the PCI bus; never initialize the runtime."""
    cpu_num = (environ.get("CPU_NUM_DEVICES") or "").strip()  # empty: not set
    count = int(cpu_num) if re.fullmatch(r"[0-9]+", cpu_num) and int(cpu_num) > 0 else None
    pjrt = environ.get("PJRT_DEVICE") or None
    tpu = _TpuScan(0, None, None, None)
    if pjrt is None or pjrt.upper().startswith("TPU"):
        tpu = _tpu_chips(environ.get("TPU_ACCELERATOR_TYPE") or None)
    return Hardware(pjrt_device=pjrt, tpu_chips=tpu.chips, tpu_cores_per_chip=tpu.cores_per_chip,
                    tpu_generation=tpu.generation, torch_xla_tpu_chips=tpu.torch_xla_chips,
                    cpu_num_devices=count,
                    bad_cpu_num_devices=cpu_num if cpu_num and count is None else None,
                    xla_thread_pool_size=environ.get("XLA_THREAD_POOL_SIZE"),
                    param_aliasing=environ.get("XLA_ENABLE_PARAM_ALIASING"),
                    device_files=_device_files(pjrt))


def _device_files(pjrt_device: Optional[str]) -> Tuple[str, ...]:
    return device_files(_device_type(pjrt_device or ""))


def device_files(device: str) -> Tuple[str, ...]:
    """The device files of ``device`` ("TPU", "CUDA") this machine shows."""
    return tuple(sorted(path for pattern in DEVICE_FILES.get(device, ())
                        for path in glob.glob(pattern)))


TORCH_XLA_INSTALL_HINT = (
    "On a Colab or Kaggle TPU runtime it comes preinstalled: check that the runtime type is "
    "TPU. Elsewhere: pip install torch torch_xla (the two versions must match, e.g. both "
    "2.9.0), then restart the kernel.")
TORCH_XLA_MISSING = ("torch_xla is not installed in this kernel's environment, and "
                     "%%xla_spawn runs on it. " + TORCH_XLA_INSTALL_HINT)


class TorchXlaMissing(SetupError, ImportError):
    """torch_xla cannot be imported (the message says how to install it)."""


def import_torch_xla():
    """Import torch_xla's multiprocessing module, leaving PJRT_DEVICE alone.

    A plain ``import torch_xla`` picks a default device and writes it into this process's
    environment (with a logged warning); the notebook's process only launches replicas,
    so it keeps its environment as the user left it.
    """
    if "torch_xla.distributed.xla_multiprocessing" in sys.modules:
        return sys.modules["torch_xla.distributed.xla_multiprocessing"]
    saved = os.environ.get("PJRT_SELECT_DEFAULT_DEVICE")
    os.environ["PJRT_SELECT_DEFAULT_DEVICE"] = "0"
    try:
        # An Interrupt waits for the import to end (seconds): one cut half-way would leave
        # torch's modules half-initialized, and every later run broken, until a restart.
        with interrupts.held() as interrupted:
            import torch_xla.distributed.xla_multiprocessing as xmp
        interrupted.raise_if_requested()
    except ImportError as exc:
        raise TorchXlaMissing(TORCH_XLA_MISSING) from exc
    finally:
        if saved is None:
            os.environ.pop("PJRT_SELECT_DEFAULT_DEVICE", None)
        else:
            os.environ["PJRT_SELECT_DEFAULT_DEVICE"] = saved
    return xmp


class _TpuScan(NamedTuple):
    chips: int
    cores_per_chip: Optional[int]
    generation: Optional[str]
    torch_xla_chips: Optional[int]  # what torch_xla's own PCI table counts


@functools.lru_cache(maxsize=None)  # the hardware does not change while the kernel lives
def _tpu_chips(accelerator_type: Optional[str] = None) -> _TpuScan:
    """TPU chips on the PCI bus, their generation and replicas per chip.

    The generation comes from the PCI device id, else from TPU_ACCELERATOR_TYPE, else from
    torch_xla's metadata query bounded by METADATA_TIMEOUT: torch_xla's version() reads
    the GCE metadata server with no timeout unless TPU_SKIP_MDS_QUERY is set, and in a
    container without one it can wait forever (pytorch/xla#6568, #8297).
    """
    import_torch_xla()
    from torch_xla._internal import tpu
    ids = _pci_tpu_devices()
    theirs = tpu.num_available_chips()  # torch_xla's own PCI scan: safe before xmp.spawn
    chips = max(len(ids), theirs)
    if not chips:
        return _TpuScan(0, None, None, theirs)
    generation, per_chip = TPU_PCI_DEVICES[ids[0]] if len(set(ids)) == 1 else (None, None)
    if len(ids) < theirs:  # a chip only this torch_xla knows
        generation, per_chip = None, None
    if generation is None:
        generation, per_chip = from_accelerator_type(accelerator_type)
    if generation is None:
        per_chip = _bounded(tpu.num_logical_cores_per_chip, METADATA_TIMEOUT)
    return _TpuScan(chips, per_chip, generation, theirs)


def _pci_tpu_devices() -> List[str]:
    """The PCI device ids of the TPU chips on this host's bus (as torch_xla reads them)."""
    found = []
    for vendor_path in sorted(glob.glob(PCI_DEVICES_GLOB)):
        try:
            with open(vendor_path) as f:
                if f.read().strip() != GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor_path), "device")) as f:
                device = f.read().strip()
        except OSError:
            continue
        if device in TPU_PCI_DEVICES:
            found.append(device)
    return found


def from_accelerator_type(accelerator_type: Optional[str]) -> Tuple[Optional[str], Optional[int]]:
    """("v5e", 1) from "v5litepod-8" or "v5e-1"; ("7x", None) from "tpu7x-8"; else (None, None)."""
    match = re.match(r"^(?:v|tpu)(\d)([a-z]*)-\d+$", accelerator_type or "")
    if not match:
        return None, None
    version, kind = int(match.group(1)), match.group(2)
    if version <= 3:
        return "v2/v3", 2
    if version >= 7:
        return f"{version}x", None
    return f"v{version}{'e' if kind == 'litepod' else kind}", 1


def _bounded(call: Callable[[], int], timeout: float) -> Optional[int]:
    """``call()``, or None if it fails or has not returned after ``timeout`` seconds (it is
    left to finish in a daemon thread: nothing waits for it)."""
    answer: List[int] = []
    done = threading.Event()

    def run() -> None:
        try:
            answer.append(call())
        except Exception:  # noqa: BLE001 - metadata unreachable: count unknown
            pass
        finally:
            done.set()

    threading.Thread(target=run, name="colab_xla-tpu-metadata", daemon=True).start()
    return answer[0] if done.wait(timeout) and answer else None


def runtime_initialized() -> bool:
    """True if this process already initialized the XLA runtime (never initializes it)."""
    torch_xla = sys.modules.get("torch_xla")
    return bool(torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized())
