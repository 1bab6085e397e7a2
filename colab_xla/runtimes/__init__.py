"""The runtimes a cell can run in (``--runtime``), one module each, behind one interface
(:class:`Runtime`, in :mod:`.base`):

* :mod:`.torch_xla` (the default): XLA replicas, through xmp.spawn, or on CPU the
  simulation of a TPU host;
* :mod:`.jax`: N JAX processes with ``jax.distributed`` initialized before the cell;
* :mod:`.torch`: N ``torch.distributed`` processes, as torchrun starts them, with the
  default process group initialized before the cell.

What their replica halves use is here too, below the replica side that calls them
(:mod:`colab_xla.runtimes.torch_xla_process`, the CPU simulation's :mod:`.cpu_sim` and
collectives, :mod:`.runtime_clients`, :mod:`.thread`).

The notebook gets a runtime by name (:func:`get`); a replica process gets its own from its
environment (:func:`current`), where the plan named it. Everything that depends on the
runtime asks it; no other module compares runtime names.

Example::

    >>> RUNTIMES, get().name, get(RUNTIMES[1]) is registered()[1]
    (('torch_xla', 'jax', 'torch'), 'torch_xla', True)
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Union

from ..errors import OptionError, Problem
from . import jax, torch, torch_xla
from .base import VARIABLE, Runtime

__all__ = ["RUNTIMES", "VARIABLE", "Runtime", "current", "get", "registered", "started_by"]

# Every runtime, the default first (the magics' --runtime choices, in this order).
_REGISTERED: Dict[str, Runtime] = {r.name: r for r in (torch_xla.RUNTIME, jax.RUNTIME,
                                                        torch.RUNTIME)}
RUNTIMES = tuple(_REGISTERED)


def registered():
    """Every runtime, the default first."""
    return tuple(_REGISTERED.values())


def get(name: Union[str, Runtime, None] = None) -> Runtime:
    """The runtime called ``name`` (None: the default; a runtime: itself), or
    :class:`colab_xla.errors.OptionError` naming the choices."""
    if isinstance(name, Runtime):
        return name
    if name is None:
        return registered()[0]
    try:
        return _REGISTERED[name]
    except KeyError:
        raise OptionError(f"--runtime {name}: use {_choices()}.") from None


def current(environ: Mapping[str, str] = os.environ) -> Runtime:
    """The runtime of a replica whose environment is ``environ`` (as its plan set it:
    :data:`VARIABLE`, unset for the default; a name no runtime has: the default)."""
    return _REGISTERED.get(environ.get(VARIABLE, ""), registered()[0])


def started_by(problem: Problem) -> Optional[Runtime]:
    """The runtime whose start in the notebook's process ``problem`` is, or None."""
    return next((r for r in registered() if r.started_code == problem.code), None)


def _choices() -> str:
    """``"torch_xla (the default) or jax"``."""
    names = [f"{RUNTIMES[0]} (the default)", *RUNTIMES[1:]]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
