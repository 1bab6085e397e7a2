"""The simulation's collectives inside ``torch.compile``: run between the compiled pieces.

What Dynamo can trace of torch_xla's collectives is torch's functional collectives
(``torch.ops._c10d_functional``): ``xm.all_reduce`` of one tensor (no scale, no groups,
pinned layout) becomes one, ``xm.all_gather``'s default form is built on it, and Dynamo
turns the ``xla`` backend's ``dist.all_reduce`` and friends into them. torch_xla lowers them
into the XLA graph, where a simulated replica's device is a world of one. :func:`install`
gives them, on XLA tensors, a kernel that calls ``colab_xla::collective``, an operator with
a kernel for CPU tensors only (:mod:`colab_xla.runtimes.collective_op`): torch_xla's CPU
fallback runs
it, and openxla's Dynamo bridge, which compiles a graph in pieces around a fallback op,
runs it between them at every call, as the simulation's eager collective on CPU copies.
(While compiling, the bridge runs the graph twice more; every replica compiles the same
graphs at the same calls, so their collectives still meet.) Any other collective calls
torch_xla's C extension, which Dynamo cannot trace, here as on a TPU: a graph break, or
``Unsupported`` with ``fullgraph=True``.
"""

from __future__ import annotations

import functools
import warnings

# The functional collectives torch_xla 2.8/2.9 lower into the graph (XLA kernels), which
# install() gives to the operator; and wait_tensor, which must be its too: compiled after a
# fallback op, a wait followed by the in-place copy of dist.all_reduce lost the result.
FUNCTIONAL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
              "wait_tensor")


def install(group) -> None:
    """Make torch's functional collectives on this replica's XLA tensors ``group``'s."""
    # (imported here: it imports torch, and this module is the notebook's too)
    from . import collective_op

    collective_op.use(group)
    _define(collective_op.collective)


@functools.lru_cache(maxsize=None)
def _define(collective) -> None:
    """Torch's functional collectives on XLA tensors: ``collective``'s (once a process)."""
    import torch

    library = torch.library.Library("_c10d_functional", "IMPL")
    kernels = {
        "all_reduce": lambda t, op, name: collective(t, "all_reduce", op, 0, name),
        "all_gather_into_tensor": lambda t, size, name: collective(
            t, "all_gather_into_tensor", "", 0, name),
        "reduce_scatter_tensor": lambda t, op, size, name: collective(
            t, "reduce_scatter_tensor", op, 0, name),
        "broadcast": lambda t, src, name: collective(t, "broadcast", "", src, name),
        "wait_tensor": lambda t: collective(t, "wait_tensor", "", 0, ""),
    }
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": ours
        warnings.simplefilter("ignore")
        for name in FUNCTIONAL:  # (torch_xla gives broadcast one in Python, over all_reduce)
            library.impl(name, kernels[name], "XLA", allow_override=True)
    _define.library = library  # a Library's registrations last as long as it does
