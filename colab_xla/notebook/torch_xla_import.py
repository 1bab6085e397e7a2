"""torch_xla in the notebook's own process: imported for the launcher (xmp.spawn) and for
the TPU scan (its PCI table), leaving the environment alone, and never initialized
(:func:`colab_xla.runtimes.torch_xla.runtime_initialized` tells if a cell did); and what
another runtime's replicas would each import (:func:`preload`).
"""

from __future__ import annotations

import importlib
import os
import sys

from . import interrupts
from ..errors import SetupError
from ..runtimes.torch_xla import TORCH_XLA_MISSING, TorchXlaMissing


XMP = "torch_xla.distributed.xla_multiprocessing"  # torch_xla's launcher


def preload(modules, *, required: bool = True) -> None:
    """Import ``modules`` (a runtime's :attr:`~colab_xla.runtimes.Runtime.preloads`) in
    the notebook's process, as :func:`import_torch_xla` imports torch_xla's launcher;
    one that fails to import is a :class:`~colab_xla.errors.SetupError`, or skipped
    unless ``required``."""
    for name in modules:
        try:
            _import(name)
        except ImportError as exc:
            if not required:
                continue
            raise SetupError(f"{name} is installed but cannot be imported here: "
                             f"{type(exc).__name__}: {exc}") from exc


def import_torch_xla():
    """Import torch_xla's multiprocessing module, leaving PJRT_DEVICE alone, or
    :class:`~colab_xla.runtimes.torch_xla.TorchXlaMissing`."""
    try:
        return _import(XMP)
    except ImportError as exc:
        raise TorchXlaMissing(TORCH_XLA_MISSING) from exc


def _import(name: str):
    """Import module ``name`` whole, leaving the environment alone.

    A plain ``import torch_xla`` picks a default device and writes it into this process's
    environment (with a logged warning); the notebook's process only launches replicas,
    so it keeps its environment as the user left it.
    """
    if name in sys.modules:
        return sys.modules[name]
    saved = os.environ.get("PJRT_SELECT_DEFAULT_DEVICE")
    os.environ["PJRT_SELECT_DEFAULT_DEVICE"] = "0"
    try:
        # An Interrupt waits for the import to end (seconds): one cut half-way would leave
        # torch's modules half-initialized, and every later run broken, until a restart.
        with interrupts.held() as interrupted:
            module = importlib.import_module(name)
        interrupted.raise_if_requested()
    finally:
        if saved is None:
            os.environ.pop("PJRT_SELECT_DEFAULT_DEVICE", None)
        else:
            os.environ["PJRT_SELECT_DEFAULT_DEVICE"] = saved
    return module
