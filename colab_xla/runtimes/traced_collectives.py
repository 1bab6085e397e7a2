"""The simulation's collectives inside ``torch.compile``: run between the compiled pieces.

What Dynamo can trace of torch_xla's collectives is torch's functional collectives
(``torch.ops._c10d_functional``): ``xm.all_reduce`` of one tensor (no scale, no groups,
pinned layout) becomes one, ``xm.all_gather``'s default form is built on it, and Dynamo
turns the ``xla`` backend's ``dist.all_reduce`` and friends into them. torch_xla lowers them
into the XLA graph, where a simulated replica's device is a world of one. :func:`install`
gives them, on XLA tensors, a kernel that calls :data:`OP`, an operator with a kernel for
CPU tensors only (:mod:`colab_xla.runtimes.collective_op`): torch_xla's CPU fallback runs
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
from typing import List, Optional

OP = "colab_xla::collective"

# The functional collectives torch_xla 2.8/2.9 lower into the graph (XLA kernels), which
# install() gives to OP; and wait_tensor, which must be OP's too: compiled after a fallback
# op, a wait followed by the in-place copy of dist.all_reduce lost the result.
FUNCTIONAL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
              "wait_tensor")

# c10d's reduce-op names (Dynamo's dist.all_reduce) as xla_model's; "avg" is a sum, divided.
_REDUCE_OPS = {"sum": "sum", "avg": "sum", "product": "mul", "band": "and", "bor": "or",
               "min": "min", "max": "max", "mul": "mul", "and": "and", "or": "or"}

_group = None  # the replica's GlooGroup (or ShmGroup), set by install()


def install(group) -> None:
    """Make torch's functional collectives on this replica's XLA tensors ``group``'s."""
    global _group
    _group = group
    _define()


@functools.lru_cache(maxsize=None)
def _define() -> None:
    import torch

    from .collective_op import collective  # (defined as the module is imported: torch's)

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


def run(kind: str, tensor, reduce_op: str, src: int, members: Optional[List[int]]):
    """Functional collective ``kind`` of CPU ``tensor`` over ``members`` (None: everyone)."""
    import torch

    if kind == "wait_tensor":  # the collective is done: it ran where it was called
        return tensor.clone()
    group = _group
    try:
        reduce_type = _REDUCE_OPS[reduce_op] if reduce_op else "sum"
    except KeyError:
        raise ValueError(f"{kind}: reduce op {reduce_op!r} is not one of "
                         f"{', '.join(_REDUCE_OPS)}") from None
    size = len(members) if members else group.world
    if kind == "all_reduce":
        result = group.all_reduce(reduce_type, [tensor], members)[0]
        return result.div_(size) if reduce_op == "avg" else result
    if kind == "all_gather_into_tensor":
        return torch.cat(group.all_gather(tensor, members), dim=0)
    if kind == "reduce_scatter_tensor":
        reduced = group.all_reduce(reduce_type, [tensor], members)[0]
        if reduce_op == "avg":
            reduced.div_(size)
        return reduced.chunk(size, dim=0)[group.position(members)].clone()
    if kind == "broadcast":
        everyone = group.all_gather(tensor, members)
        return everyone[members.index(src) if members else src].clone()
    raise ValueError(f"no functional collective {kind!r}")


def size(group_name: str) -> int:
    """How many replicas torch.distributed's group ``group_name`` has."""
    return len(members(group_name) or range(_group.world))


def members(group_name: str) -> Optional[List[int]]:
    """The ranks of torch.distributed's group ``group_name`` (None: everyone)."""
    if not group_name:
        return None
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    try:
        ranks = dist.get_process_group_ranks(distributed_c10d._resolve_process_group(group_name))
    except (LookupError, RuntimeError, ValueError):
        return None
    return None if len(ranks) == _group.world else sorted(ranks)
