"""The operator ``colab_xla::collective`` (:data:`colab_xla.runtimes.traced_collectives.OP`):
one functional collective of a CPU tensor over the simulation's replicas, which
:mod:`colab_xla.runtimes.traced_collectives` gives torch's functional collectives on XLA
tensors.

Defined when imported, as a torch library defines its operators. The notebook's process
imports it before it forks (:attr:`colab_xla.runtimes.torch_xla.TorchXla.preloads`), so
that a forked replica finds it defined rather than each defining it; outside a replica
nothing calls it.
"""

from __future__ import annotations

import torch

from . import traced_collectives as traced
from .traced_collectives import OP


@torch.library.custom_op(OP, mutates_args=(), device_types="cpu", schema=(
    "(Tensor tensor, str kind, str reduce_op, int src, str group_name) -> Tensor"))
def collective(tensor, kind, reduce_op, src, group_name):
    return traced.run(kind, tensor, reduce_op, src, traced.members(group_name))


@collective.register_fake
def _(tensor, kind, reduce_op, src, group_name):
    shape = list(tensor.shape)
    size = traced.size(group_name)
    if kind == "all_gather_into_tensor":
        shape[0] *= size
    elif kind == "reduce_scatter_tensor":
        shape[0] //= size
    return tensor.new_empty(shape)
