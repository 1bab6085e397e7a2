"""What a runtime plans from and what it plans: the value types the runtimes and the
notebook share. A leaf: it imports nothing of colab_xla but :mod:`colab_xla.errors`.

* :class:`Hardware`: what the notebook found on this machine without initializing any
  runtime (:func:`colab_xla.notebook.hardware.detect`);
* :class:`ReplicaPlan`: how a run's replicas start (device, count, processes, their
  variables), made by a runtime's ``plan``;
* :class:`ReplicaCountError`: a count the hardware cannot run, refused before anything starts.

Example::

    >>> Hardware(pjrt_device=None, tpu_chips=4).device
    'TPU'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ..errors import SetupError


class ReplicaCountError(SetupError, ValueError):
    """The hardware cannot run the number of replicas asked for (the message says why)."""


class DeviceMissing(ReplicaCountError):
    """PJRT_DEVICE names an accelerator this machine does not have: no replica can run."""


# Device files each accelerator shows on Linux (TPU v4 and earlier: accel; v5e and later:
# VFIO groups; NVIDIA GPUs).
DEVICE_FILES = {"TPU": ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*"),
                "CUDA": ("/dev/nvidia[0-9]*",), "GPU": ("/dev/nvidia[0-9]*",)}


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
        return device_type(self.pjrt_device or ("TPU" if self.tpu_chips else "CPU"))


def device_type(pjrt_device: str) -> str:
    """``"TPU"`` from ``"TPU"``, ``"tpu"`` or ``"TPU_C_API"``."""
    return pjrt_device.upper().split("_")[0]


@dataclass(frozen=True)
class ReplicaPlan:
    """How to start the replicas: device type, replica count, environment for them, and
    the runtime that planned them (a :class:`colab_xla.runtimes.Runtime`), which the
    launcher and the replicas then ask."""

    device_type: str
    replicas: Optional[int]  # None: xmp.spawn's own count (unknown here)
    env: Dict[str, Optional[str]] = field(default_factory=dict)  # None: unset it
    note: Optional[str] = None  # one line to tell the user, or None
    processes: int = 1  # replica processes (one per TPU chip; on CPU, see simulation)
    # On CPU, the model simulated (colab_xla.runtimes.simulation.SIMULATIONS); None on
    # other devices.
    simulation: Optional[str] = None
    runtime: Any = None  # the colab_xla.runtimes.Runtime that made this plan

    @property
    def own_processes(self) -> bool:
        """Whether colab_xla starts one process per replica itself, instead of the
        runtime's own launcher (the runtime says)."""
        return self.runtime.own_processes(self)
