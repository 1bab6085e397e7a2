"""What this machine has, read without initializing any runtime: :func:`detect` reads
PJRT_DEVICE, CPU_NUM_DEVICES and the variables the CPU simulation keeps, the accelerator's
device files, and the TPU chips on the PCI bus (:mod:`colab_xla.notebook.tpu_scan`, which
asks the TPU metadata server only when nothing else says which TPU this is, bounded in
time) into a :class:`colab_xla.runtimes.plan.Hardware`, which a runtime plans from.

The notebook's own process must never initialize the XLA runtime (xmp.spawn refuses to
start afterwards, and a forked replica of an initialized process hangs)::

    >>> hw = detect({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "6"})
    >>> hw.device, hw.cpu_num_devices
    ('CPU', 6)
"""

from __future__ import annotations

import glob
import os
import re
from typing import Mapping, Optional, Tuple

from . import tpu_scan
from ..runtimes.plan import DEVICE_FILES, Hardware, device_type

__all__ = ["detect", "device_files", "Hardware"]


def detect(environ: Mapping[str, str] = os.environ) -> Hardware:
    """Read PJRT_DEVICE, CPU_NUM_DEVICES and the PCI bus; never initialize the runtime."""
    cpu_num = (environ.get("CPU_NUM_DEVICES") or "").strip()  # empty: not set
    count = int(cpu_num) if re.fullmatch(r"[0-9]+", cpu_num) and int(cpu_num) > 0 else None
    pjrt = environ.get("PJRT_DEVICE") or None
    tpu = tpu_scan.NO_TPU
    if pjrt is None or pjrt.upper().startswith("TPU"):
        tpu = tpu_scan.tpu_chips(environ.get("TPU_ACCELERATOR_TYPE") or None)
    return Hardware(pjrt_device=pjrt, tpu_chips=tpu.chips, tpu_cores_per_chip=tpu.cores_per_chip,
                    tpu_generation=tpu.generation, torch_xla_tpu_chips=tpu.torch_xla_chips,
                    cpu_num_devices=count,
                    bad_cpu_num_devices=cpu_num if cpu_num and count is None else None,
                    xla_thread_pool_size=environ.get("XLA_THREAD_POOL_SIZE"),
                    param_aliasing=environ.get("XLA_ENABLE_PARAM_ALIASING"),
                    device_files=_device_files(pjrt))


def _device_files(pjrt_device: Optional[str]) -> Tuple[str, ...]:
    return device_files(device_type(pjrt_device or ""))


def device_files(device: str) -> Tuple[str, ...]:
    """The device files of ``device`` ("TPU", "CUDA") this machine shows."""
    return tuple(sorted(path for pattern in DEVICE_FILES.get(device, ())
                        for path in glob.glob(pattern)))
