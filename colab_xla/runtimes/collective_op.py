"""The operator ``colab_xla::collective`` (:data:`OP`): one functional collective of a CPU
tensor over the replica's group (:func:`use`), to which
:mod:`colab_xla.runtimes.traced_collectives` gives torch's functional collectives on XLA
tensors.

Defined when imported, as a torch library defines its operators. The notebook's process
imports it before it forks a simulation's replicas
(:attr:`colab_xla.runtimes.torch_xla.TorchXla.simulation_preloads`), so that a forked
replica finds it defined rather than each defining it; outside a replica nothing calls it.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

OP = "colab_xla::collective"

# c10d's reduce-op names (Dynamo's dist.all_reduce) as xla_model's; "avg" is a sum, divided.
_REDUCE_OPS = {"sum": "sum", "avg": "sum", "product": "mul", "band": "and", "bor": "or",
               "min": "min", "max": "max", "mul": "mul", "and": "and", "or": "or"}

_group = None  # the replica's GlooGroup (or ShmGroup), set by use()


def use(group) -> None:
    """Run this process's collectives over ``group`` (the replica's)."""
    global _group
    _group = group


@torch.library.custom_op(OP, mutates_args=(), device_types="cpu", schema=(
    "(Tensor tensor, str kind, str reduce_op, int src, str group_name) -> Tensor"))
def collective(tensor, kind, reduce_op, src, group_name):
    return run(kind, tensor, reduce_op, src, members(group_name))


@collective.register_fake
def _(tensor, kind, reduce_op, src, group_name):
    shape = list(tensor.shape)
    size = len(members(group_name) or range(_group.world))
    if kind == "all_gather_into_tensor":
        shape[0] *= size
    elif kind == "reduce_scatter_tensor":
        shape[0] //= size
    return tensor.new_empty(shape)


def run(kind: str, tensor, reduce_op: str, src: int, members: Optional[List[int]]):
    """Functional collective ``kind`` of CPU ``tensor`` over ``members`` (None: everyone)."""
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


def members(group_name: str) -> Optional[List[int]]:
    """The ranks of torch.distributed's group ``group_name`` (None: everyone)."""
    if not group_name:
        return None
    try:
        ranks = dist.get_process_group_ranks(distributed_c10d._resolve_process_group(group_name))
    except (LookupError, RuntimeError, ValueError):
        return None
    return None if len(ranks) == _group.world else sorted(ranks)
