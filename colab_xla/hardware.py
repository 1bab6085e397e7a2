"""Which device the replicas run on and how many there are, without initializing XLA.

The notebook's own process must never initialize the XLA runtime (xmp.spawn refuses to
start afterwards, and a forked replica of an initialized process hangs). Everything here
reads environment variables and the PCI bus only.

:func:`plan_replicas` is a pure function of what :func:`detect` found, so every rule is
testable without hardware::

    >>> plan = plan_replicas(4, Hardware(pjrt_device=None, tpu_chips=0))
    >>> plan.device_type, plan.replicas, plan.env["CPU_NUM_DEVICES"]
    ('CPU', 4, '4')
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Dict, Iterator, Mapping, Optional

# A simulated host has as many replicas as a TPU v2-8/v3-8 host, so notebooks written for
# Colab's TPU run unchanged on a laptop.
DEFAULT_CPU_REPLICAS = 8

RUNTIME_INITIALIZED = (
    "The XLA runtime is already initialized in this notebook's own process, so replicas cannot "
    "be started: xmp.spawn refuses, and a replica forked from this process would hang. An "
    "earlier cell called one of torch_xla.device(), xm.xla_device(), xr.world_size(), "
    "xr.global_ordinal(), xr.addressable_device_count(), or moved a tensor to an XLA device.")
RUNTIME_INITIALIZED_FIX = (
    "restart the runtime (Runtime > Restart session, or Kernel > Restart), then use the XLA "
    "device only inside %%xla_spawn cells, where `device` is each replica's device.")


class ReplicaCountError(ValueError):
    """The hardware cannot run the number of replicas asked for (the message says why)."""


@dataclass(frozen=True)
class Hardware:
    """What is known without initializing the runtime."""

    pjrt_device: Optional[str]  # PJRT_DEVICE as the user set it, or None
    tpu_chips: int = 0  # TPU chips on the PCI bus
    tpu_cores_per_chip: Optional[int] = None  # 2 on v2/v3, 1 later; None if unknown
    cpu_num_devices: Optional[int] = None  # CPU_NUM_DEVICES as the user set it
    xla_thread_pool_size: Optional[str] = None  # XLA_THREAD_POOL_SIZE as the user set it
    param_aliasing: Optional[str] = None  # XLA_ENABLE_PARAM_ALIASING as the user set it


@dataclass(frozen=True)
class ReplicaPlan:
    """How to start the replicas: device type, replica count, environment for them."""

    device_type: str
    replicas: Optional[int]  # None: xmp.spawn's own count (unknown here)
    env: Dict[str, Optional[str]] = field(default_factory=dict)  # None: unset it
    note: Optional[str] = None  # one line to tell the user, or None
    processes: int = 1  # replica processes xmp.spawn starts (one per TPU chip)


def plan_replicas(requested: Optional[int], hw: Hardware) -> ReplicaPlan:
    """Decide device and replica count, or raise :class:`ReplicaCountError`.

    On CPU, N replicas are N CPU devices of one process (``CPU_NUM_DEVICES``), so any
    N >= 1 works. A TPU host always runs every local TPU core (xmp.spawn accepts no other
    count). Other PJRT devices run xmp.spawn's default.
    """
    if requested is not None and requested < 1:
        raise ReplicaCountError(f"-n {requested}: the number of replicas must be 1 or more.")
    device = (hw.pjrt_device or ("TPU" if hw.tpu_chips else "CPU")).upper().split("_")[0]

    if device == "CPU":
        n = requested or hw.cpu_num_devices or DEFAULT_CPU_REPLICAS
        note = None
        if hw.pjrt_device is None:
            note = (f"colab_xla: no TPU found, running {n} replica{'s' if n != 1 else ''} on CPU "
                    f"(PJRT_DEVICE=CPU, CPU_NUM_DEVICES={n}).")
        env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(n)}
        if hw.xla_thread_pool_size is None:
            # A collective blocks one XLA pool thread per replica until all have arrived:
            # fewer threads than replicas (the default is the core count) hangs.
            env["XLA_THREAD_POOL_SIZE"] = str(max(n + 2, 8))
        if n > 1 and hw.param_aliasing is None:
            # Replica threads run each collective as a program of its own (see
            # replica._serialize_cpu_compiles); with parameter buffers donated to the step
            # that updates them, a training loop that never calls torch_xla.sync() after
            # xm.optimizer_step meets a deleted buffer at its second step.
            env["XLA_ENABLE_PARAM_ALIASING"] = "0"
        return ReplicaPlan("CPU", n, env, note)

    if device == "TPU":
        total = hw.tpu_chips * hw.tpu_cores_per_chip if hw.tpu_cores_per_chip else None
        if requested is not None and requested != total:
            how = (f"this TPU host has {total} TPU cores ({hw.tpu_chips} chips x "
                   f"{hw.tpu_cores_per_chip} cores), so it runs {total} replicas"
                   if total else "the number of TPU cores on this host could not be read")
            raise ReplicaCountError(
                f"-n {requested}: {how}. xmp.spawn always uses every local TPU core. "
                + (f"Use -n {total} or leave -n out." if total else "Leave -n out.")
                + " To simulate another count, run on CPU replicas: "
                "os.environ['PJRT_DEVICE'] = 'CPU' before the cell.")
        return ReplicaPlan("TPU", total, {"PJRT_DEVICE": hw.pjrt_device or "TPU"},
                           processes=hw.tpu_chips)

    if requested is not None:
        raise ReplicaCountError(
            f"-n {requested}: on PJRT_DEVICE={hw.pjrt_device} the replica count is set by "
            f"that device's own variable ({device}_NUM_DEVICES); leave -n out.")
    return ReplicaPlan(device, None, {"PJRT_DEVICE": hw.pjrt_device})


def detect(environ: Mapping[str, str] = os.environ) -> Hardware:
    """Read PJRT_DEVICE, CPU_NUM_DEVICES and the PCI bus; never initialize the runtime."""
    cpu_num = environ.get("CPU_NUM_DEVICES")
    pjrt = environ.get("PJRT_DEVICE") or None
    chips, per_chip = 0, None
    if pjrt is None or pjrt.upper().startswith("TPU"):
        chips, per_chip = _tpu_chips()
    return Hardware(pjrt_device=pjrt, tpu_chips=chips, tpu_cores_per_chip=per_chip,
                    cpu_num_devices=int(cpu_num) if cpu_num and cpu_num.isdigit() else None,
                    xla_thread_pool_size=environ.get("XLA_THREAD_POOL_SIZE"),
                    param_aliasing=environ.get("XLA_ENABLE_PARAM_ALIASING"))


TORCH_XLA_INSTALL_HINT = (
    "On a Colab or Kaggle TPU runtime it comes preinstalled: check that the runtime type is "
    "TPU. Elsewhere: pip install torch torch_xla (the two versions must match, e.g. both "
    "2.9.0), then restart the kernel.")
TORCH_XLA_MISSING = ("torch_xla is not installed in this kernel's environment, and "
                     "%%xla_spawn runs on it. " + TORCH_XLA_INSTALL_HINT)


class TorchXlaMissing(ImportError):
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
        with interrupts_deferred():
            import torch_xla.distributed.xla_multiprocessing as xmp
    except ImportError as exc:
        raise TorchXlaMissing(TORCH_XLA_MISSING) from exc
    finally:
        if saved is None:
            os.environ.pop("PJRT_SELECT_DEFAULT_DEVICE", None)
        else:
            os.environ["PJRT_SELECT_DEFAULT_DEVICE"] = saved
    return xmp


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold an Interrupt (SIGINT) until the block has ended, then raise it.

    An import cut half-way leaves torch's and torch_xla's modules half-initialized in
    ``sys.modules`` for the kernel's life (every later run fails, only a restart helps),
    so the import of torch and torch_xla (seconds, on a first run) finishes first.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


@functools.lru_cache(maxsize=None)  # the hardware does not change while the kernel lives
def _tpu_chips():
    import_torch_xla()
    from torch_xla._internal import tpu
    chips = tpu.num_available_chips()  # PCI scan: safe before xmp.spawn
    if not chips:
        return 0, None
    try:
        return chips, tpu.num_logical_cores_per_chip()
    except Exception:  # TPU metadata unreachable: count unknown, xmp.spawn still knows
        return chips, None


def runtime_initialized() -> bool:
    """True if this process already initialized the XLA runtime (never initializes it)."""
    torch_xla = sys.modules.get("torch_xla")
    return bool(torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized())
