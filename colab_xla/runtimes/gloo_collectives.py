"""torch_xla's collectives between replica processes that XLA itself cannot connect, over gloo.

torch_xla 2.9's CPU client has no collectives across processes: two ``PJRT_DEVICE=CPU``
processes each see a world of one. When colab_xla simulates a TPU host as one process per
replica (:mod:`colab_xla.runtimes.cpu_sim`), :func:`install` makes each process answer as replica
``rank`` of ``world`` (``xr.world_size()``, ``xr.global_ordinal()``, ``xr.process_index()``
and friends) and replaces the collectives of ``xla_model`` (``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_to_all``, ``collective_permute``, ``xla_rendezvous``) with the same
operation done by gloo on CPU copies of the tensors. Everything built on them follows:
``xm.optimizer_step``, ``xm.rendezvous``, ``xm.mesh_reduce``, ``collective_broadcast``, the
``xla`` torch.distributed backend and DDP over it.

What this does not reproduce: a collective is not part of the XLA graph (the inputs are
computed and copied to the CPU, then the result copied back), so a step with collectives
runs as several programs, and ``torch_xla.compile(full_graph=True)`` allows that execution
during a collective instead of refusing it; nor does XLA's refusal of pinned and unpinned
all-reduces in one program. Arguments are checked as torch_xla checks them, with its errors,
and an ``output=`` takes its result's value and shape, as torch_xla's ``_out`` collectives.
Under ``torch.compile``, what torch_xla can trace runs between the compiled pieces
(:mod:`colab_xla.runtimes.traced_collectives`).

The group is a gloo process group of its own, never torch.distributed's default one, so a
cell's own ``init_process_group`` (``xla``, ``gloo``) is as free as on a TPU. The store that
introduces the processes to each other is given: a file in the run's private directory for
the processes of one host (whose gloo connections are then on 127.0.0.1), a TCP store kept
by host 0's agent on its host's address for the hosts of a cluster (keys under a secret).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from typing import Dict, List, Optional, Sequence, Tuple

from . import traced_collectives

# What install() replaces or sets in torch_xla: private names are checked first.
RUNTIME_NAMES = ("_WORLD_SIZE", "_ORDINAL", "process_index", "process_count",
                 "global_device_count", "global_runtime_device_count")
XLA_MODEL_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                   "collective_permute", "xla_rendezvous")
XLAC_NAMES = ("_get_allow_execution", "_set_allow_execution", "_xla_get_cpu_tensors",
              "_replace_xla_tensor", "_xla_get_tensor_id")
# torch_xla's reduce types (xm.REDUCE_SUM and friends), as its C++ reads them.
REDUCE_TYPES = ("sum", "mul", "and", "or", "min", "max")

# XLA makes a buffer of memory it did not allocate only at this alignment (torch's CPU
# allocator gives it).
XLA_ALIGNMENT = 64

# How long a collective waits for the other replicas. A replica that never arrives has
# failed, and the run stops the others long before this (the fail-fast rule).
TIMEOUT = datetime.timedelta(hours=1)


def missing(xr, xm, xlac) -> List[str]:
    """What :func:`install` needs and this torch_xla lacks (a release that renamed it)."""
    return ([f"torch_xla.runtime.{n}" for n in RUNTIME_NAMES if not hasattr(xr, n)]
            + [f"xla_model.{n}" for n in XLA_MODEL_NAMES if not hasattr(xm, n)]
            + [f"torch_xla._XLAC.{n}" for n in XLAC_NAMES if not hasattr(xlac, n)])


class GlooGroup:
    """The replicas of a run as one gloo group: rank ``rank`` of ``world``, met through
    ``store``; groups of some replicas (``groups=[[0, 1], [2, 3]]``) made on first use."""

    def __init__(self, store, rank: int, world: int, *, hostname: str = "127.0.0.1"):
        self.store, self.rank, self.world = store, rank, world
        self._hostname = hostname
        self._device = None  # gloo's transport, made with the first group (a few ms)
        self._groups: Dict[Tuple[int, ...], object] = {}
        self._rendezvous_round = 0

    def group(self, members: Optional[Sequence[int]] = None):
        """``(gloo process group, this replica's position in it)`` for ``members``."""
        import torch.distributed as dist

        key = tuple(members) if members else tuple(range(self.world))
        pg = self._groups.get(key)
        if pg is None:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = TIMEOUT
            if self._device is None:
                self._device = dist.ProcessGroupGloo.create_device(hostname=self._hostname)
            options._devices = [self._device]
            store = dist.PrefixStore("group-" + "-".join(map(str, key)), self.store)
            with _quiet_fd(1):  # gloo prints "[Gloo] Rank 0 is connected to 3 peer ranks"
                pg = dist.ProcessGroupGloo(store, key.index(self.rank), len(key), options)
            self._groups[key] = pg
        return pg, key.index(self.rank)

    def position(self, members: Optional[Sequence[int]] = None) -> int:
        """This replica's position in ``members`` (None: everyone)."""
        return list(members).index(self.rank) if members else self.rank

    def members(self, groups: Optional[Sequence[Sequence[int]]]) -> Optional[List[int]]:
        """This replica's group among ``groups`` (None: everyone)."""
        return group_of(self.rank, groups)

    # -- the operations, on CPU tensors ------------------------------------------------------

    def all_reduce(self, reduce_type: str, tensors: List, members=None,
                   scale: float = 1.0) -> List:
        """``tensors`` (CPU) reduced over ``members``, then, floating point ones, times
        ``scale`` (as XLA applies it), in new tensors."""
        import torch
        import torch.distributed as dist

        pg, _ = self.group(members)
        options = dist.AllreduceOptions()
        options.reduceOp = _reduce_op(reduce_type)
        results = []
        for tensor in tensors:
            bool_ = tensor.dtype == torch.bool
            work = tensor.to(torch.uint8) if bool_ else tensor.contiguous().clone()
            pg.allreduce([work], options).wait()
            if scale != 1.0 and work.is_floating_point():
                work.mul_(scale)
            results.append(work.to(torch.bool) if bool_ else work)
        return results

    def all_gather(self, tensor, members=None) -> List:
        import torch

        pg, _ = self.group(members)
        size = len(members) if members else self.world
        outputs = [torch.empty_like(tensor) for _ in range(size)]
        pg.allgather([outputs], [tensor.contiguous()]).wait()
        return outputs

    def permute(self, tensor, pairs: Sequence[Sequence[int]]):
        """``collective_permute``: what the pair whose target is this replica sent, or
        zeros; only the replicas named in ``pairs`` need to call it."""
        import torch

        pg, _ = self.group()
        works, result = [], torch.zeros_like(tensor)
        for source, target in pairs:
            if source == self.rank:
                works.append(pg.send([tensor.contiguous()], target, 0))
            if target == self.rank:
                works.append(pg.recv([result], source, 0))
        for work in works:
            work.wait()
        return result

    def exchange(self, payload: bytes) -> List[bytes]:
        """Every replica's ``payload``, by ordinal (``xm.rendezvous``), through the store."""
        round_ = self._rendezvous_round
        self._rendezvous_round += 1
        keys = [f"rendezvous/{round_}/{rank}" for rank in range(self.world)]
        self.store.set(keys[self.rank], payload)
        self.store.wait(keys, TIMEOUT)
        return [bytes(self.store.get(key)) for key in keys]


def group_of(rank: int, groups: Optional[Sequence[Sequence[int]]]) -> Optional[List[int]]:
    """The group of ``rank`` among xla_model's ``groups`` (None: no groups, everyone)."""
    if not groups:
        return None
    for members in groups:
        if rank in members:
            return list(members)
    raise ValueError(f"replica {rank} is in none of the groups {groups}")


@contextlib.contextmanager
def _quiet_fd(fd: int):
    """Nothing written to ``fd`` (C level) for a while."""
    import os

    saved = os.dup(fd)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(null)


def _reduce_op(reduce_type: str):
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "mul": dist.ReduceOp.PRODUCT, "and": dist.ReduceOp.BAND,
           "or": dist.ReduceOp.BOR, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    try:
        return ops[reduce_type]
    except KeyError:
        raise ValueError(f"Invalid reduce type: {reduce_type!r} (one of "
                         f"{', '.join(ops)})") from None


def file_store(path: str, world: int):
    """The store of the replica processes of one host: a file every one of them can open."""
    import torch.distributed as dist

    # Made 0600 before torch opens it (each process does, so whichever is first makes it).
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    return dist.FileStore(path, world)


def tcp_store(address: str, prefix: str):
    """The store of the replicas of several hosts (a cluster's CPU hosts): a client of the
    TCP store at ``address`` (``ip:port/secret``, kept by host 0's agent), under the
    secret and ``prefix`` (the run or session, the same on every host): anyone who can
    reach the address can connect to a TCP store, but not name these keys."""
    import torch.distributed as dist

    where, _, secret = address.partition("/")
    host, _, port = where.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
    return dist.PrefixStore("/".join(p for p in (secret, prefix) if p) + "/", store)


def install(group: GlooGroup) -> None:
    """Make this process replica ``group.rank`` of ``group.world`` for torch_xla, with its
    collectives through ``group``. Check :func:`missing` first."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    world, rank = group.world, group.rank
    # world_size() and global_ordinal() answer these once set (torch_xla caches them so
    # that Dynamo does not break graphs on them).
    xr._WORLD_SIZE, xr._ORDINAL = world, rank
    xr.process_index = functools.wraps(xr.process_index)(lambda: rank)
    xr.process_count = functools.wraps(xr.process_count)(lambda: world)
    xr.global_device_count = functools.wraps(xr.global_device_count)(lambda: world)
    xr.global_runtime_device_count = functools.wraps(xr.global_runtime_device_count)(
        lambda: world)
    ops = _Collectives(group, torch_xla._XLAC)
    for name in XLA_MODEL_NAMES:
        setattr(xm, name, _in_place_of(getattr(xm, name), getattr(ops, name),
                                       TRACEABLE.get(name, _never)))
    traced_collectives.install(group)


def _never(*args, **kwargs) -> bool:
    return False


# The calls of xla_model's collectives that torch_xla 2.9 itself lets Dynamo trace (through
# torch's functional all_reduce); it cannot trace any other form, on any device.
TRACEABLE = {
    "all_reduce": lambda reduce_type, inputs, scale=1.0, groups=None, pin_layout=True:
        _is_tensor(inputs) and scale == 1.0 and not groups and pin_layout,
    "all_gather": lambda value, dim=0, groups=None, output=None, pin_layout=True, *a, **k:
        _is_tensor(value) and output is None and pin_layout,
}


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _in_place_of(original, implementation, traceable):
    """``implementation``, under ``original``'s name and docstring. Where Dynamo traces the
    call (torch.compile), a form torch_xla's own can trace is ``original``
    (:mod:`.traced_collectives` runs it); any other is a graph break, run as
    ``implementation`` (with ``fullgraph=True``, Dynamo's ``Unsupported``, as torch_xla's)."""
    import torch

    untraced = torch._dynamo.disable(implementation)

    @functools.wraps(original)
    def call(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return implementation(*args, **kwargs)
        if traceable(*args, **kwargs):
            return original(*args, **kwargs)
        return untraced(*args, **kwargs)
    return call


class _Collectives:
    """xla_model's collectives, same signatures, done by gloo on CPU copies."""

    def __init__(self, group: GlooGroup, xlac):
        self._group, self._xlac = group, xlac
        # Whether this torch_xla moves tensors to and from the CPU by DLPack (see _cpu).
        self._dlpack = all(hasattr(xlac, name) for name in (
            "_to_dlpack", "_from_dlpack", "_xla_sync_multi", "_xla_wait_device_ops"))

    @contextlib.contextmanager
    def _on_cpu(self):
        """Inside ``torch_xla.compile(full_graph=True)`` execution is refused; a collective
        here must run what computes its inputs."""
        import torch

        allowed = self._xlac._get_allow_execution()
        self._xlac._set_allow_execution(True)
        try:
            with torch.no_grad():
                yield
        finally:
            self._xlac._set_allow_execution(allowed)

    def _cpu(self, tensors: List) -> List:
        """``tensors`` on the CPU, to be read only. What the replica has queued runs first,
        as one program (as the step would have on a TPU up to its collective): syncing
        only the inputs would leave the parameters' updates pending, and a graph that
        grows and compiles again at every step of a loop that never syncs itself.

        An XLA tensor comes as a view of its buffer (the XLA CPU device's memory is the
        process's) through DLPack, without a copy: torch_xla's copy to the host
        (``_xla_get_cpu_tensors``) is slower than the collective itself. The buffer must
        exist first (torch_xla aborts the process on a
        tensor whose buffer is still being computed): the inputs are synced, and waited
        for."""
        import torch_xla

        xla = [t for t in tensors if t.device.type == "xla"]
        if not xla:
            return list(tensors)
        torch_xla.sync()
        if _dlpack_dtypes().intersection(t.dtype for t in xla) and self._dlpack:
            self._xlac._xla_sync_multi(xla, devices=[], wait=True)
            self._xlac._xla_wait_device_ops(devices=[])
            views = iter([self._view(t) for t in xla])
        else:
            views = iter(self._xlac._xla_get_cpu_tensors(xla))
        return [next(views) if t.device.type == "xla" else t for t in tensors]

    def _view(self, tensor):
        """A CPU view of XLA ``tensor``'s buffer (synced), or a copy where DLPack cannot."""
        import torch

        if tensor.dtype not in _dlpack_dtypes() or tensor.numel() == 0:
            return self._xlac._xla_get_cpu_tensors([tensor])[0]
        return torch.from_dlpack(self._xlac._to_dlpack(tensor))

    def _back(self, result, like):
        """CPU tensor ``result`` on ``like``'s device: an XLA tensor made on ``result``'s
        memory through DLPack (no copy, unless it is a part of a larger tensor that XLA
        cannot take as it is), or a copy where DLPack cannot."""
        import torch

        if (like.device.type != "xla" or result.dtype not in _dlpack_dtypes()
                or result.numel() == 0 or not self._dlpack):
            return result.to(like.device)
        if not result.is_contiguous() or result.data_ptr() % XLA_ALIGNMENT:
            result = result.clone(memory_format=torch.contiguous_format)  # torch aligns it
        return self._xlac._from_dlpack(result.__dlpack__())

    def all_reduce(self, reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
        import torch

        single = isinstance(inputs, torch.Tensor)
        tensors = [inputs] if single else list(inputs)
        _check_reduce_type(reduce_type)
        _check_xla(tensors)
        with self._on_cpu():
            results = self._group.all_reduce(reduce_type, self._cpu(tensors),
                                             self._group.members(groups), scale)
            if single:
                return self._back(results[0], inputs)
            for tensor, result in zip(tensors, results):
                tensor.copy_(self._back(result, tensor))
        return inputs

    def all_gather(self, value, dim=0, groups=None, output=None, pin_layout=True,
                   channel_id=None, use_global_device_ids=None):
        import torch

        single = isinstance(value, torch.Tensor)
        # torch_xla's checks, in its order (a single tensor, pinned, with no output, is its
        # all_reduce of a padded tensor, which checks nothing here)
        if groups and not (single and pin_layout and output is None):
            assert all(len(group) == len(groups[0]) for group in groups), \
                "Replica groups must have the same number of replicas/shards."
        if not single and not _tensor_list(value):
            raise TypeError("`value` needs to be a Tensor or a list of Tensors, but "
                            f"given {type(value)}.")
        values = [value] if single else value
        if not single and pin_layout:
            raise RuntimeError("For xm.all_gather with list of tensors input, "
                               "pin_layout=True is not yet supported.")
        if not single and output is not None:
            _check_outputs(output, values, len_bug=True)
        _check_xla(values + _outputs(output, single))
        members = self._group.members(groups)
        with self._on_cpu():
            gathered = [self._back(torch.cat(self._group.all_gather(t, members), dim=dim), v)
                        for t, v in zip(self._cpu(values), values)]
            return self._into(output, gathered, single)

    def reduce_scatter(self, reduce_type, input, scale, scatter_dim, shard_count,
                       groups=None, output=None, pin_layout=True, channel_id=None,
                       use_global_device_ids=None):
        import torch

        single = isinstance(input, torch.Tensor)
        if not single and not _tensor_list(input):
            raise TypeError("`input` needs to be a Tensor or a list of Tensors, but "
                            f"given {type(input)}.")
        inputs = [input] if single else input
        if not single and output is not None:
            _check_outputs(output, inputs)
        _check_reduce_type(reduce_type)
        _check_xla(inputs + _outputs(output, single))
        members = self._group.members(groups)
        position = self._group.position(members)
        with self._on_cpu():
            reduced = self._group.all_reduce(reduce_type, self._cpu(inputs), members, scale)
            shards = [self._back(r.chunk(shard_count, dim=scatter_dim)[position], i)
                      for r, i in zip(reduced, inputs)]
            return self._into(output, shards, single)

    def all_to_all(self, value, split_dimension, concat_dimension, split_count, groups=None,
                   pin_layout=True):
        import torch

        _check_xla([value])
        members = self._group.members(groups)
        position = self._group.position(members)
        with self._on_cpu():
            everyone = self._group.all_gather(self._cpu([value])[0], members)
            pieces = [v.chunk(split_count, dim=split_dimension)[position] for v in everyone]
            return self._back(torch.cat(pieces, dim=concat_dimension), value)

    def collective_permute(self, value, pairs):
        _check_xla([value])
        with self._on_cpu():
            return self._back(self._group.permute(self._cpu([value])[0], pairs), value)

    def xla_rendezvous(self, payload: bytes = b"", ordinals=None, tag=None):
        import torch_xla

        if ordinals and len(ordinals) != self._group.world:
            raise ValueError("Only global rendezvous is supported")
        if not isinstance(payload, bytes):
            raise TypeError(f"`payload` must be bytes, not {type(payload)}")
        torch_xla.sync()  # as torch_xla's: what the replica queued runs first
        return self._group.exchange(payload)

    def _into(self, output, results: List, single: bool):
        """``results``, or the caller's ``output`` (a tensor, or a list) holding them: as
        torch_xla's ``_out`` collectives do, each output tensor (the same object) takes its
        result's value and shape, whatever its own shape was."""
        if output is None:
            return results[0] if single else results
        for out, result in zip(_outputs(output, single), results):
            self._xlac._replace_xla_tensor(out, result)
        return output


@functools.lru_cache(maxsize=None)
def _dlpack_dtypes() -> frozenset:
    """The dtypes a collective's tensors cross between XLA and the CPU as they are, by
    DLPack (bool and complex are copied)."""
    import torch

    return frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16,
                      torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))


def _tensor_list(value) -> bool:
    """Whether ``value`` is what torch_xla takes as several tensors: a list (not a tuple)."""
    import torch

    return isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value)


def _outputs(output, single: bool) -> List:
    return [] if output is None else [output] if single else list(output)


def _check_outputs(output, inputs: List, *, len_bug: bool = False) -> None:
    """torch_xla's checks of a list ``output`` for a list of inputs, its errors included
    (all_gather's message for a length that differs calls ``len(input)``, of the builtin
    ``input``: torch_xla 2.9 raises that TypeError instead of its ValueError)."""
    if not _tensor_list(output):
        raise TypeError(f"`output` needs to be a list of Tensors, but given {type(output)}.")
    if len(output) != len(inputs):
        if len_bug:
            len(input)  # noqa: F821 -- as torch_xla's, whatever ``input`` is in the replica
        raise ValueError("`output` length doesn't match `input` length: "
                         f"{len(output)} vs {len(inputs)}.")


def _check_reduce_type(reduce_type) -> None:
    if reduce_type not in REDUCE_TYPES:
        raise RuntimeError(f"Unknown AllReduce type: {reduce_type}")


def _check_xla(tensors) -> None:
    """torch_xla's collectives take XLA tensors only: another is refused with the error of
    this torch_xla's own C++ (which asks for a tensor's XLA id: no work, no communication)."""
    import torch_xla

    for tensor in tensors:
        if tensor.device.type != "xla":
            torch_xla._XLAC._xla_get_tensor_id(tensor)
            raise RuntimeError(f"Expected XLA tensor. Got: {tensor.type()}")
