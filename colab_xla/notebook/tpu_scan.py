"""The TPU chips of this host, found without initializing any runtime: the PCI bus (as
torch_xla reads it, and colab_xla's own table of chip ids), the generation from the PCI id
or ``TPU_ACCELERATOR_TYPE``, and only when neither says, torch_xla's metadata query,
bounded by :data:`METADATA_TIMEOUT`.

Example::

    >>> from_accelerator_type("v5litepod-8")
    ('v5e', 1)
"""

from __future__ import annotations

import functools
import glob
import os
import re
import threading
from typing import Callable, List, NamedTuple, Optional, Tuple

from ..runtimes.torch_xla import TorchXlaMissing
from .torch_xla_import import import_torch_xla

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


class TpuScan(NamedTuple):
    chips: int
    cores_per_chip: Optional[int]
    generation: Optional[str]
    torch_xla_chips: Optional[int]  # what torch_xla's own PCI table counts


NO_TPU = TpuScan(0, None, None, None)


@functools.lru_cache(maxsize=None)  # the hardware does not change while the kernel lives
def tpu_chips(accelerator_type: Optional[str] = None) -> TpuScan:
    """TPU chips on the PCI bus, their generation and replicas per chip.

    The generation comes from the PCI device id, else from TPU_ACCELERATOR_TYPE, else from
    torch_xla's metadata query bounded by METADATA_TIMEOUT: torch_xla's version() reads
    the GCE metadata server with no timeout unless TPU_SKIP_MDS_QUERY is set, and in a
    container without one it can wait forever (pytorch/xla#6568, #8297).
    """
    tpu = _torch_xla_tpu()
    ids = _pci_tpu_devices()
    # torch_xla's own PCI scan (safe before xmp.spawn), where it is installed.
    theirs = tpu.num_available_chips() if tpu is not None else None
    chips = max(len(ids), theirs or 0)
    if not chips:
        return TpuScan(0, None, None, theirs)
    generation, per_chip = TPU_PCI_DEVICES[ids[0]] if len(set(ids)) == 1 else (None, None)
    if len(ids) < (theirs or 0):  # a chip only this torch_xla knows
        generation, per_chip = None, None
    if generation is None:
        generation, per_chip = from_accelerator_type(accelerator_type)
    if generation is None and tpu is not None:
        per_chip = _bounded(tpu.num_logical_cores_per_chip, METADATA_TIMEOUT)
    return TpuScan(chips, per_chip, generation, theirs)


def _torch_xla_tpu():
    """torch_xla's TPU module, or None where torch_xla is not installed (a machine with
    PyTorch alone runs --runtime torch: the PCI scan here is enough)."""
    try:
        import_torch_xla()
    except TorchXlaMissing:
        return None
    from torch_xla._internal import tpu

    return tpu


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
