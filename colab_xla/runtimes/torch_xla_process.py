"""A replica process of the torch_xla runtime, set up once
(:meth:`colab_xla.runtimes.torch_xla.TorchXla.start_process` calls it): torch_xla's
persistent compilation cache (``--cache``), and torch_xla instrumented so that a cell
behaves as in a notebook and a cut run can say where each replica was: ``xm.rendezvous``
recorded, a nested ``xmp.spawn`` refused with the reason, ``xm.master_print`` to the
replica's output, the APIs torch_xla 2.x removed named with their replacement, the cell's
deprecation warnings shown with its lines, and on CPU the simulation's collectives
(:mod:`colab_xla.runtimes.cpu_sim`).

``process`` is the replica's :class:`colab_xla.replica.process.ReplicaProcess` (its
``rank``, ``host_rank``, ``writer`` and ``cell``), passed in: this module does not import it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import types
import warnings
from typing import Dict

from . import cpu_sim, gloo_collectives
from .bound_names import rebind
from ..wire.frames import NOTE
from .thread import current


class _CurrentStdout:
    """``sys.stdout`` as it is when written to (in a replica: the replica's own)."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def initialize_cache(cache_dir: str, rank: int) -> None:
    """``--cache``: torch_xla's persistent compilation cache, one directory per replica
    process (its files are written without atomic renames), set before the process
    compiles anything, so a rerun loads the executables instead of compiling."""
    import torch_xla.runtime as xr

    path = os.path.join(cache_dir, f"process-{rank}")
    os.makedirs(path, exist_ok=True)
    xr.initialize_cache(path, readonly=False)


# The modules whose functions instrument() replaces (TorchXla.replaces).
REPLACED_IN = ("torch_xla", "torch_xla.core.xla_model",
               "torch_xla.distributed.xla_multiprocessing", "torch_xla.runtime")


def instrument(process, run_dir: str) -> None:
    """Instrument torch_xla in this replica process (see above): each replica's last
    ``xm.rendezvous`` tag recorded (told when a run is cut), a nested ``xmp.spawn``
    refused with the reason; on CPU, the simulation's collectives installed (between the
    processes of ``run_dir``'s run, or every host's). Each function replaced is replaced
    under the names bound to it before too (``from torch_xla.core.xla_model import
    all_reduce`` in the notebook: :func:`colab_xla.runtimes.bound_names.rebind`)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_multiprocessing as xmp
    import torch_xla.runtime  # noqa: F401 - one of REPLACED_IN

    replaced_in = [sys.modules[name] for name in REPLACED_IN]
    before = {(module, name): value for module in replaced_in
              for name, value in list(vars(module).items())
              if isinstance(value, types.FunctionType)}
    _instrument(process, run_dir, xm, xmp)
    # (a name the notebook bound calls what the attribute calls: torch_xla's own
    # all_reduce would reduce a world of one in a replica process, and stop a replica
    # thread's process in XLA's rendezvous)
    rebind({old: getattr(module, name) for (module, name), old in before.items()
            if getattr(module, name, old) is not old}, process.user_ns, process.bindings)


def _instrument(process, run_dir: str, xm, xmp) -> None:
    rendezvous = xm.rendezvous

    def recorded_rendezvous(tag, *args, **kwargs):
        ordinal = getattr(current, "ordinal", None)
        if ordinal is not None:
            process.writer.send(NOTE, ordinal, json.dumps({"rendezvous": str(tag)}).encode())
        return rendezvous(tag, *args, **kwargs)

    def nested_spawn(*args, **kwargs):
        raise RuntimeError("xmp.spawn was called inside a %%xla_spawn replica, which "
                           "would start replicas from every replica. Put the function's "
                           "body in the cell instead (`index` is the ordinal).")

    xm.rendezvous = functools.wraps(rendezvous)(recorded_rendezvous)
    # xm.master_print's default fd is the sys.stdout of the moment torch_xla was first
    # imported: in a forked replica, the notebook's stream (or one closed since), which
    # the replica's output never reaches. Write where the replica's print goes.
    defaults = getattr(xm.master_print, "__kwdefaults__", None) or {}
    if "fd" in defaults:
        defaults["fd"] = _CurrentStdout()
    xmp.spawn = functools.wraps(xmp.spawn)(nested_spawn)
    _name_removed_apis(xm, REMOVED_XLA_MODEL_APIS)
    # torch_xla's deprecation warnings name the replacement (xm.xla_device: "Use
    # torch_xla.device instead"); Python hides them outside __main__: show the cell's.
    warnings.filterwarnings("default", category=DeprecationWarning,
                            module=CELL_MODULES)
    warnings.formatwarning = _cell_lines_named(warnings.formatwarning, process)
    # Warnings go to the replica's stderr, whatever hook the notebook's process had
    # (a test runner's recorder, say: in a replica nobody would read it).
    warnings.showwarning = _show_warning
    if os.environ.get("PJRT_DEVICE") == "CPU":
        processes = int(os.environ.get("PJRT_LOCAL_PROCESS_COUNT", "1"))
        cluster = process.host_rank
        if cluster is not None and cluster.store:  # CPU hosts: every host's replicas
            cpu_sim.install_processes(
                cluster.index(process.rank), cluster.world,
                gloo_collectives.tcp_store(cluster.store, cluster.run),
                hostname=cluster.address)
        elif processes > 1:  # one process per replica (see colab_xla.notebook.launch)
            cpu_sim.install_processes(process.rank, processes, gloo_collectives.file_store(
                os.path.join(run_dir, "replicas.store"), processes), one_machine=True)
        elif int(os.environ.get("CPU_NUM_DEVICES", "1")) > 1:
            cpu_sim.install(xm)


# What torch_xla 2.x removed (with XRT) that code written for 1.x still calls, and what
# replaces it: the AttributeError a replica gets names the replacement.
REMOVED_XLA_MODEL_APIS = {
    "xrt_world_size": "torch_xla.runtime.world_size()",
    "get_ordinal": "torch_xla.runtime.global_ordinal()",
}


def _name_removed_apis(module: types.ModuleType, removed: Dict[str, str]) -> None:
    """``module.NAME`` of a removed API raises an AttributeError that names its
    replacement (a module ``__getattr__``, called only for names the module lacks)."""
    def __getattr__(name):
        if name in removed:
            raise AttributeError(f"{module.__name__}.{name} was removed in torch_xla 2.x: "
                                 f"use {removed[name]} instead")
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    if not hasattr(module, "__getattr__"):
        module.__getattr__ = __getattr__


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """``warnings.showwarning`` of a replica process: to its stderr."""
    text = warnings.formatwarning(message, category, filename, lineno, line)
    with contextlib.suppress(OSError, ValueError):  # as warnings' own: a closed stream
        (file or sys.stderr).write(text)


# The modules of cells (colab_xla.wire.cell names them), each replica's own (``_r<ordinal>``).
CELL_MODULES = r"xla_cell_\d+_[0-9a-f]+(_r\d+)?\Z"


def _cell_lines_named(formatwarning, process):
    """A warning from the cell names its line as a traceback does (``Cell In[5], line
    3``), not the cell's temporary file."""
    @functools.wraps(formatwarning)
    def named(message, category, filename, lineno, line=None):
        text = formatwarning(message, category, filename, lineno, line)
        cell = process.cell
        if cell is not None and filename == cell.path:
            text = text.replace(f"{filename}:{lineno}:", f"{cell.label}, line {lineno}:", 1)
        return text
    return named
