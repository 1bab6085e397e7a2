"""Collectives between the replica processes of one machine, through shared memory.

The CPU simulation runs a process per replica (:mod:`colab_xla.replica.cpu_sim`), and
:mod:`colab_xla.replica.gloo_collectives` gives them torch_xla's collectives. Gloo sends
every byte through a TCP socket of the loopback device and wakes its threads for each
message: an ``xm.all_reduce`` of 16 MiB between 8 processes on 2 cores took ~290 ms, and
one of 1 KiB ~26 ms. Processes of one machine can read each other's memory instead.
:class:`ShmGroup` does ``all_reduce`` and ``all_gather`` (and with them
``reduce_scatter``, ``all_to_all``, ``xm.optimizer_step``) that way, and leaves the rest
(``collective_permute``, groups of some replicas) to gloo:

* Every replica of the group has a *slot* of ``2 x`` :data:`CHUNK_BYTES` in one file in
  ``/dev/shm``, mapped by all of them. A collective goes through its data a chunk at a
  time, the two halves in turn.
* ``all_reduce``: each replica copies its chunk into its slot; a barrier; replica ``p``
  reduces the ``p``-th piece of the chunk over all slots (every replica gets the same bits,
  as from one reduction); a barrier. The slots are folded in rank order, but for a float32
  or float64 sum into a result file: one ``torch.sum`` over every slot's piece (the slots
  are one strided tensor), a single pass, in about 30% less time than a pass per slot
  (0.6 against 0.87 ms for a 512 KiB piece of 8 slots), in an association of torch's own.
  A tensor of a chunk or more is reduced (where ``/dev/shm`` has room to spare:
  :func:`room_for_result`) into a *result file* replica 0 made for the call, which every
  replica then maps copy-on-write as its result: no copy out, and no fresh pages per
  replica (a 16 MiB result cost each of 8 replicas a copy and 4,096 page faults: without
  them, its CPU time in the collective went from 10-13 ms to 6-7 ms on 2 cores), and XLA
  writing into its buffer writes into a page of its own. A smaller one is reduced into
  replica 0's slot and copied out.
* ``all_gather``: each copies its chunk in; a barrier; each copies every slot out.
* A barrier is a byte written to a FIFO and read from another (replica 0 counts the
  arrivals, then releases everyone): a replica waiting sleeps in ``read`` (a busy wait
  would take the core from the replica being waited for: 8 replicas share 2 cores), and
  an Interrupt reaches it there, as it cannot inside gloo's native wait.
* The two halves of a slot take turns, so a replica writes a chunk only after every
  replica has read the chunk before the previous one: two barriers per chunk, none more.

A slot's pages are taken when the group is made (``posix_fallocate`` of its range of the
file, by its replica): a page first touched on a full ``/dev/shm`` would kill the replica
with SIGBUS in the middle of a collective. If any replica's slot finds no room, every
replica learns it, the whole group goes through gloo, and replica 0 says why on its stderr
(with ``/dev/shm``'s size, and how to make it larger).

Nothing is left on disk but the group's directory, empty between collectives: once every
replica has opened the group's files, they are removed (a mapping and an open FIFO outlive
their name), and so is each result file once every replica has opened it; replica 0
removes the directory with the group, and the next run removes one whose replica 0 is gone
(:func:`colab_xla.wire.shared_tensors.prune`).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import shutil
from typing import Callable, Dict, List, Optional

from ..wire import shared_tensors
from .gloo_collectives import TIMEOUT, GlooGroup

# Each replica's slot holds two chunks of this size (8 MiB of shared memory a replica).
CHUNK_BYTES = 4 << 20
# What a result file must leave free in /dev/shm, beyond twice its own size (the results of
# the step before may still live): DataLoader workers' batches and the notebook's large
# results go there too. With less, a result is copied out, as a smaller one is.
ROOM_LEFT_BYTES = 256 << 20


def available(root: str = shared_tensors.SHM_ROOT) -> bool:
    """Whether this machine has the shared memory the group needs."""
    return os.path.isdir(root) and os.access(root, os.W_OK)


class ShmGroup(GlooGroup):
    """The replica processes of one machine as one group: rank ``rank`` of ``world``, met
    through ``store``. ``all_reduce`` and ``all_gather`` of the whole group go through
    shared memory (made on first use); the rest through gloo, as in :class:`GlooGroup`."""

    def __init__(self, store, rank: int, world: int, *, root: str = shared_tensors.SHM_ROOT,
                 chunk_bytes: int = CHUNK_BYTES):
        super().__init__(store, rank, world)
        self._root, self._chunk_bytes = root, chunk_bytes
        self._shared: Optional[_Shared] = None
        self._no_room = False  # shared memory was tried and had none: gloo for good

    def _whole(self, members) -> Optional[_Shared]:
        """The shared memory of the whole group, or None where ``members`` is a part of
        it, or where it had no room (those go through gloo)."""
        if members and list(members) != list(range(self.world)):
            return None
        if self._shared is None and not self._no_room:
            self._shared = _Shared.meet(self.store, self.rank, self.world, self._root,
                                        self._chunk_bytes)
            self._no_room = self._shared is None
        return self._shared

    def all_reduce(self, reduce_type: str, tensors: List, members=None) -> List:
        shared = self._whole(members)
        if shared is None:
            return super().all_reduce(reduce_type, tensors, members)
        import torch

        reduce = _reducer(reduce_type)
        results: List = [None] * len(tensors)
        by_dtype: Dict[object, List[int]] = {}
        for i, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(i)
        for dtype, indices in by_dtype.items():
            parts = [tensors[i].to(torch.uint8) if dtype == torch.bool else tensors[i]
                     for i in indices]
            flat = (parts[0].reshape(-1) if len(parts) == 1
                    else torch.cat([p.reshape(-1) for p in parts]))
            reduced = shared.all_reduce(flat.contiguous(), reduce)
            offset = 0
            for i, part in zip(indices, parts):
                result = reduced[offset:offset + part.numel()].view(part.shape)
                results[i] = result.to(torch.bool) if dtype == torch.bool else result
                offset += part.numel()
        return results

    def all_gather(self, tensor, members=None) -> List:
        shared = self._whole(members)
        if shared is None:
            return super().all_gather(tensor, members)
        return shared.all_gather(tensor.contiguous())

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None


class _Shared:
    """The group's slots and barrier, once every replica has opened them."""

    def __init__(self, rank: int, world: int, chunk_bytes: int, slots: mmap.mmap,
                 arrive: int, release: Dict[int, int], directory: str):
        import torch

        self.rank, self.world, self.chunk_bytes = rank, world, chunk_bytes
        self.directory = directory  # the result files' (kept while the group lives)
        self._results = 0  # result files named so far: the same count on every replica
        self._map = slots
        # [rank, half]: slot rank's two halves, as bytes, in one mapping (a piece of every
        # slot is one strided tensor: a sum reads them all in one pass)
        self._halves = torch.frombuffer(slots, dtype=torch.uint8).view(world, 2, chunk_bytes)
        self._arrive, self._release = arrive, release  # release: every rank's, on rank 0
        self._turn = 0  # which half the next chunk uses: the same count on every replica

    @classmethod
    def meet(cls, store, rank: int, world: int, root: str,
             chunk_bytes: int) -> Optional["_Shared"]:
        """Take this replica's slot in the group's file and make its FIFO, wait for every
        replica's, open them all, then remove their names (see the module's docstring);
        None, on every replica, if a slot found no room in ``root`` (replica 0 says so)."""
        slots_path = None
        if rank == 0:
            directory = shared_tensors.make_private_dir("collectives", root)
            slots_path = os.path.join(directory, "slots")
            os.close(os.open(slots_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            store.set("shm/dir", directory.encode())
        store.wait(["shm/dir"], TIMEOUT)
        directory = bytes(store.get("shm/dir")).decode()
        slots_path = os.path.join(directory, "slots")
        fifo_path = os.path.join(directory, f"release-{rank}")
        fd = os.open(slots_path, os.O_RDWR)
        try:
            try:  # every page now: one first touched on a full /dev/shm is a SIGBUS
                os.posix_fallocate(fd, 2 * chunk_bytes * rank, 2 * chunk_bytes)
                made = b""
            except OSError as exc:
                made = (exc.strerror or str(exc)).encode()
            os.mkfifo(fifo_path, 0o600)
            if rank == 0:
                os.mkfifo(os.path.join(directory, "arrive"), 0o600)
            store.set(f"shm/made/{rank}", made)
            store.wait([f"shm/made/{r}" for r in range(world)], TIMEOUT)
            said = {r: bytes(store.get(f"shm/made/{r}")).decode() for r in range(world)}
            failed = {r: why for r, why in said.items() if why}
            if not failed:
                slots = mmap.mmap(fd, 2 * chunk_bytes * world)
        finally:
            os.close(fd)
        if failed:  # every replica learns it: the whole group goes through gloo
            os.unlink(fifo_path)
            store.set(f"shm/gone/{rank}", b"")
            if rank == 0:
                store.wait([f"shm/gone/{r}" for r in range(world)], TIMEOUT)
                shutil.rmtree(directory, ignore_errors=True)
                _say_no_room(root, world, chunk_bytes, failed)
            return None
        # O_RDWR: a FIFO opened so never blocks in open, and never reads an end of file.
        arrive = os.open(os.path.join(directory, "arrive"), os.O_RDWR)
        release = [os.open(os.path.join(directory, f"release-{r}"), os.O_RDWR)
                   for r in (range(world) if rank == 0 else [rank])]
        shared = cls(rank, world, chunk_bytes, slots, arrive,
                     dict(zip(range(world) if rank == 0 else [rank], release)), directory)
        shared.barrier()  # everyone has opened everything: the names can go
        os.unlink(fifo_path)
        shared.barrier()
        if rank == 0:
            os.unlink(os.path.join(directory, "arrive"))
            os.unlink(slots_path)
        return shared

    def barrier(self, arrived: Optional[Callable[[], None]] = None) -> None:
        """Return once every replica of the group has called it. Replica 0 counts the
        arrivals, calls ``arrived()`` (if given) once every replica is there and before
        any of them goes on, then lets them go."""
        if self.rank == 0:
            waiting = self.world - 1
            while waiting:
                waiting -= len(os.read(self._arrive, waiting))
            if arrived is not None:
                arrived()
            for r in range(1, self.world):
                os.write(self._release[r], b"\0")
        else:
            os.write(self._arrive, b"\0")
            while not os.read(self._release[self.rank], 1):
                pass

    def _chunks(self, tensor):
        """``(start, stop, half)`` of each chunk of flat ``tensor``, its half taken in turn."""
        per_chunk = max(1, self.chunk_bytes // tensor.element_size())
        for start in range(0, tensor.numel(), per_chunk):
            half = self._turn
            self._turn ^= 1
            yield start, min(start + per_chunk, tensor.numel()), half

    def _slot(self, rank: int, half: int, dtype, count: int):
        return self._halves[rank, half].view(dtype)[:count]

    def _pieces(self, half: int, dtype, lo: int, hi: int):
        """Elements ``[lo, hi)`` of every slot's ``half``, as one (world, hi - lo) tensor."""
        return self._halves[:, half].view(dtype)[:, lo:hi]

    def all_reduce(self, flat, reduce: Callable) -> "object":
        """``flat`` (1-D, contiguous) reduced over the group, in a new tensor: a
        copy-on-write mapping of the call's result file for a chunk or more (see the
        module's docstring), else a copy."""
        nbytes = flat.numel() * flat.element_size()
        path = self._result_file(nbytes) if nbytes >= self.chunk_bytes else None
        result = _Result(path)
        try:
            self._reduce_into(flat, reduce, result)
            return result.tensor(flat)
        finally:
            result.close(unlink=self.rank == 0)

    def _reduce_into(self, flat, reduce: Callable, result: "_Result") -> None:
        import torch

        summed = reduce is _sum and flat.dtype in _summed_in_order()
        for start, stop, half in self._chunks(flat):
            count = stop - start
            self._slot(self.rank, half, flat.dtype, count).copy_(flat[start:stop])
            self.barrier()
            if start == 0:  # the result file was made (every page taken) before, or not
                result.open(flat)
            lo, hi = _piece(count, self.world, self.rank)
            if hi > lo:  # (folded in rank order: the same bits, in a slot or in the file)
                pieces = self._pieces(half, flat.dtype, lo, hi)
                if result.shared is None:
                    for other in pieces[1:]:
                        reduce(pieces[0], other)
                elif summed:
                    # one pass over every slot, 0 to world - 1 (not a copy, then a pass
                    # per slot: ~30% of the reduction's time)
                    torch.sum(pieces, dim=0, out=result.piece(start + lo, start + hi))
                else:
                    total = result.piece(start + lo, start + hi)
                    total.copy_(pieces[0])
                    for other in pieces[1:]:
                        reduce(total, other)
            # The last barrier: every replica has opened the result file (at the first
            # chunk), so its name goes before any of them returns.
            last = result.shared is not None and stop == flat.numel()
            self.barrier(arrived=result.unlink if last else None)
            if result.shared is None:
                result.copied[start:stop].copy_(self._slot(0, half, flat.dtype, count))

    def _result_file(self, nbytes: int) -> str:
        """The path of this call's result file; made by replica 0, with every page taken
        (a page first touched on a full ``/dev/shm`` is a SIGBUS), or not made if there is
        no room, or too little left (:func:`room_for_result`): every replica then finds
        none, and copies its result out."""
        path = os.path.join(self.directory, f"result-{self._results}")
        self._results += 1
        if self.rank == 0 and room_for_result(self.directory, nbytes):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError:
                os.unlink(path)
            finally:
                os.close(fd)
        return path

    def all_gather(self, tensor) -> List:
        """Every replica's ``tensor`` (contiguous, the same shape everywhere), by rank."""
        import torch

        flat = tensor.reshape(-1)
        outs = [torch.empty_like(tensor) for _ in range(self.world)]
        flats = [o.view(-1) for o in outs]
        for start, stop, half in self._chunks(flat):
            count = stop - start
            self._slot(self.rank, half, flat.dtype, count).copy_(flat[start:stop])
            self.barrier()
            for r in range(self.world):
                flats[r][start:stop].copy_(self._slot(r, half, flat.dtype, count))
        return outs

    def close(self) -> None:
        for fd in {self._arrive, *self._release.values()}:
            os.close(fd)
        self._halves = None
        self._map.close()
        if self.rank == 0:
            shutil.rmtree(self.directory, ignore_errors=True)


def _say_no_room(root: str, world: int, chunk_bytes: int, failed: Dict[int, str]) -> None:
    """Tell the notebook (on replica 0's stderr) why the collectives are slower."""
    import sys

    stat = os.statvfs(root)
    free, size = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    rank, why = next(iter(sorted(failed.items())))
    slot = 2 * chunk_bytes
    print(f"colab_xla: the collectives go through gloo (TCP, slower): {root} had no room "
          f"for their shared memory (replica {rank}: {why}). They need {_size(slot * world)} "
          f"({_size(slot)} a replica); {root} has {_size(free)} free of {_size(size)}. In a "
          "Docker container, --shm-size=1g makes it larger; or run fewer replicas.",
          file=sys.stderr, flush=True)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


class _Result:
    """Where one replica's all_reduce puts its result: the call's result file, mapped
    shared while the replicas reduce into it, then copy-on-write as the result; or, where
    there is none (small, or no room), a tensor the result is copied into."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self.shared: Optional[mmap.mmap] = None
        self.copied = None  # the tensor of a result copied out
        self._fd: Optional[int] = None
        self._view = None  # the shared mapping as a tensor

    def open(self, flat) -> None:
        """Open the result file if it was made; else make a tensor for a copy."""
        import torch

        if self.path is not None:
            try:
                self._fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:  # (replica 0 found no room for it)
                pass
        if self._fd is None:
            self.copied = torch.empty_like(flat)
            return
        self.shared = mmap.mmap(self._fd, flat.numel() * flat.element_size())
        self._view = torch.frombuffer(self.shared, dtype=flat.dtype)

    def piece(self, lo: int, hi: int):
        return self._view[lo:hi]

    def unlink(self) -> None:
        os.unlink(self.path)

    def tensor(self, flat):
        """The result: the copy, or the result file mapped copy-on-write (XLA writing
        into its buffer writes into pages of its own)."""
        import torch

        if self.shared is None:
            return self.copied if self.copied is not None else torch.empty_like(flat)
        self._view = None  # (the shared mapping closes once no tensor views it)
        self.shared.close()
        self.shared = None
        mine = mmap.mmap(self._fd, flat.numel() * flat.element_size(),
                         flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return torch.frombuffer(mine, dtype=flat.dtype)  # (it keeps the mapping alive)

    def close(self, unlink: bool) -> None:
        """Let go of the file, also after an interrupt (``unlink``: its name too, if the
        last barrier did not remove it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if unlink and self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def room_for_result(directory: str, nbytes: int) -> bool:
    """Whether a result file of ``nbytes`` leaves room enough in ``directory``'s file system
    (:data:`ROOM_LEFT_BYTES`)."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize >= 2 * nbytes + ROOM_LEFT_BYTES


def _piece(count: int, world: int, rank: int):
    """Elements ``[lo, hi)`` of ``count`` that replica ``rank`` reduces (some may be empty)."""
    return count * rank // world, count * (rank + 1) // world


def _sum(total, other) -> None:
    total.add_(other)


@functools.lru_cache(maxsize=None)
def _summed_in_order() -> frozenset:
    """The dtypes whose ``torch.sum`` over the slots folds them in rank order, with the
    bits of :func:`_sum` one slot after another (half floats accumulate in float32)."""
    import torch

    return frozenset((torch.float32, torch.float64))


def _reducer(reduce_type: str) -> Callable:
    """``reduce(total, other)``: ``other`` folded into ``total``, in place."""
    import torch

    ops = {"sum": _sum, "mul": torch.Tensor.mul_,
           "and": torch.Tensor.bitwise_and_, "or": torch.Tensor.bitwise_or_,
           "min": lambda total, other: torch.minimum(total, other, out=total),
           "max": lambda total, other: torch.maximum(total, other, out=total)}
    try:
        return ops[reduce_type]
    except KeyError:
        raise ValueError(f"Invalid reduce type: {reduce_type!r} (one of "
                         f"{', '.join(ops)})") from None
