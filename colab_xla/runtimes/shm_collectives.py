"""Collectives between the replica processes of one machine, through shared memory.

The CPU simulation runs a process per replica (:mod:`colab_xla.runtimes.cpu_sim`).
:class:`ShmGroup` gives them ``all_reduce`` and ``all_gather`` (and so ``reduce_scatter``,
``all_to_all``, ``xm.optimizer_step``) by reading each other's memory instead of gloo's
loopback sockets; the rest (``collective_permute``, groups of some replicas) goes to
:mod:`colab_xla.runtimes.gloo_collectives`. Against gloo: bench/results.md, "CPU simulation".

* Each replica has a *slot* of ``2 x`` :data:`CHUNK_BYTES` in one ``/dev/shm`` file they all
  map. A call goes through its tensors of one dtype as one run of elements, a chunk at a
  time, the slot's two halves in turn (a half is written again only once every replica read
  it); a barrier is a byte through FIFOs, slept on in ``read`` (a busy wait would take the
  core of the replica waited for; an Interrupt reaches it there).
* ``all_reduce``: each copies its chunk in; replica ``p`` reduces the ``p``-th piece over
  every slot, in rank order (a float sum into a result file: one ``torch.sum`` over the
  strided slots), scaling as it goes, so every replica gets the same bits. A result of a
  chunk or more goes into a reused *result file* (:class:`_Pool`) that each replica maps
  copy-on-write as its result; a smaller one is reduced into slot 0 and copied out.
  ``all_gather``: each copies its chunk in, then every slot out.

Limits: a slot's pages are allocated as the group is made (a page first touched on a full
``/dev/shm`` is a SIGBUS); if any replica finds no room, the whole group uses gloo and
replica 0 says why on its stderr. The files are removed once every replica has opened them;
the group's directory goes with replica 0 (:meth:`_Shared.close`) or with the run it
belonged to (:func:`colab_xla.wire.shared_tensors.prune`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import mmap
import os
import shutil
import weakref
from typing import Callable, Dict, List, Optional

from ..wire import shared_tensors
from .gloo_collectives import TIMEOUT, GlooGroup

# Each replica's slot holds two chunks of this size (2 MiB of shared memory a replica); a
# result of this size or more goes through a result file. (See the module's docstring.)
CHUNK_BYTES = 1 << 20
# What a result file must leave free in /dev/shm, beyond twice its own size (the results of
# the step before may still live): DataLoader workers' batches and the notebook's large
# results go there too. With less, a result is copied out, as a smaller one is.
ROOM_LEFT_BYTES = 256 << 20
# Result files a group keeps for its calls to reuse (see _Pool): a loop holding its last
# result while it makes the next takes two.
POOL_FILES = 3
# The group's table (which result file a call uses, and which replicas still hold a result
# of each), in the pages before the slots (:func:`_table_bytes`).
_BUSY_OFFSET = 512


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

    def all_reduce(self, reduce_type: str, tensors: List, members=None,
                   scale: float = 1.0) -> List:
        shared = self._whole(members)
        if shared is None:
            return super().all_reduce(reduce_type, tensors, members, scale)
        import torch

        reduce = _reducer(reduce_type)
        results: List = [None] * len(tensors)
        by_dtype: Dict[object, List[int]] = {}
        for i, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(i)
        for dtype, indices in by_dtype.items():
            parts = [tensors[i].to(torch.uint8) if dtype == torch.bool else tensors[i]
                     for i in indices]
            # (the tensors of a dtype are reduced as one run of elements, read from each
            # where it lies: not concatenated first, a copy of every byte)
            reduced = shared.all_reduce(_Input([p.contiguous().view(-1) for p in parts]),
                                        reduce, scale if dtype.is_floating_point else 1.0)
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
        self._map = slots
        # [rank, half]: slot rank's two halves, as bytes, in one mapping (a piece of every
        # slot is one strided tensor: a sum reads them all in one pass)
        self._halves = torch.frombuffer(slots, dtype=torch.uint8,
                                        offset=_table_bytes(world)).view(
            world, 2, chunk_bytes)
        self.pool = _Pool(slots, rank, world, directory)
        self._views: Dict[object, object] = {}
        self._arrive, self._release = arrive, release  # release: every rank's, on rank 0
        self._turn = 0  # which half the next chunk uses: the same count on every replica

    @classmethod
    def meet(cls, store, rank: int, world: int, root: str,
             chunk_bytes: int) -> Optional["_Shared"]:
        """Take this replica's slot in the group's file and make its FIFO, wait for every
        replica's, open them all, then remove their names (see the module's docstring);
        None, on every replica, if a slot found no room in ``root`` (replica 0 says so)."""
        if rank == 0:
            directory = shared_tensors.make_private_dir("collectives", root)
            slots_path = os.path.join(directory, "slots")
            os.close(os.open(slots_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            store.set("shm/dir", directory.encode())
        store.wait(["shm/dir"], TIMEOUT)
        directory = bytes(store.get("shm/dir")).decode()
        slots_path = os.path.join(directory, "slots")
        fifo_path = os.path.join(directory, f"release-{rank}")
        table = _table_bytes(world)
        fd = os.open(slots_path, os.O_RDWR)
        try:
            try:  # every page now: one first touched on a full /dev/shm is a SIGBUS
                if rank == 0:  # (and the table's, before the slots)
                    os.posix_fallocate(fd, 0, table)
                os.posix_fallocate(fd, table + 2 * chunk_bytes * rank, 2 * chunk_bytes)
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
                slots = mmap.mmap(fd, 2 * chunk_bytes * world + table)
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

    def _chunks(self, numel: int, itemsize: int):
        """``(start, stop, half)`` of each chunk of ``numel`` elements of ``itemsize``
        bytes, its half taken in turn."""
        per_chunk = max(1, self.chunk_bytes // itemsize)
        for start in range(0, numel, per_chunk):
            half = self._turn
            self._turn ^= 1
            yield start, min(start + per_chunk, numel), half

    def _typed(self, dtype):
        """The halves as ``dtype``: [rank, half, element] (made once: a view costs
        microseconds, and a call takes several a chunk)."""
        typed = self._views.get(dtype)
        if typed is None:
            typed = self._views[dtype] = self._halves.view(dtype)
        return typed

    def _slot(self, rank: int, half: int, dtype, count: int):
        return self._typed(dtype)[rank, half, :count]

    def _pieces(self, half: int, dtype, lo: int, hi: int):
        """Elements ``[lo, hi)`` of every slot's ``half``, as one (world, hi - lo) tensor."""
        return self._typed(dtype)[:, half, lo:hi]

    def all_reduce(self, flat: "_Input", reduce: Callable, scale: float = 1.0) -> "object":
        """``flat``'s elements reduced over the group (then times ``scale``, unless it is
        1), in a new 1-D tensor: a copy-on-write mapping of the call's result file for a
        chunk or more (see the module's docstring), else a copy."""
        nbytes = flat.numel * flat.itemsize
        large = nbytes >= self.chunk_bytes
        if large and self.rank == 0:  # (before the first barrier: every replica reads it)
            self.pool.choose(nbytes)
        result = _Result(self.pool if large else None)
        try:
            self._reduce_into(flat, reduce, scale, result)
            return result.tensor(flat)
        finally:
            result.close()

    def _reduce_into(self, flat: "_Input", reduce: Callable, scale: float,
                     result: "_Result") -> None:
        import torch

        summed = reduce is _sum and flat.dtype in _summed_in_order()
        for start, stop, half in self._chunks(flat.numel, flat.itemsize):
            count = stop - start
            flat.copy_into(self._slot(self.rank, half, flat.dtype, count), start, stop)
            self.barrier()
            if start == 0:  # (replica 0 chose the result file before)
                result.open(flat)
            lo, hi = _piece(count, self.world, self.rank)
            if hi > lo:  # (one reduction of each piece: every replica gets the same bits)
                pieces = self._pieces(half, flat.dtype, lo, hi)
                if result.shared is None:
                    total = pieces[0]
                    for other in pieces[1:]:
                        reduce(total, other)
                elif summed:
                    # one pass over every slot, 0 to world - 1 (faster than a copy, then a
                    # pass per slot)
                    total = result.piece(start + lo, start + hi)
                    torch.sum(pieces, dim=0, out=total)
                else:
                    total = result.piece(start + lo, start + hi)
                    total.copy_(pieces[0])
                    for other in pieces[1:]:
                        reduce(total, other)
                if scale != 1.0:  # (while the piece is in the cache: not a pass of its own)
                    total.mul_(scale)
            if result.shared is None:  # every piece reduced into slot 0 first
                self.barrier()
                result.copied[start:stop].copy_(self._slot(0, half, flat.dtype, count))
            elif stop == flat.numel:
                # The last barrier: the result is whole, and every replica has opened its
                # file (at the first chunk), so a new one's name goes before any returns.
                # (None before: a half is written again two chunks on, after the next
                # chunk's barrier, which every replica reaches once it reduced this one.)
                self.barrier(arrived=self.pool.unlink_new)

    def all_gather(self, tensor) -> List:
        """Every replica's ``tensor`` (contiguous, the same shape everywhere), by rank."""
        import torch

        flat = tensor.reshape(-1)
        outs = [torch.empty_like(tensor) for _ in range(self.world)]
        flats = [o.view(-1) for o in outs]
        for start, stop, half in self._chunks(flat.numel(), flat.element_size()):
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
        self._views = {}
        self.pool.close()
        _close_map(self._map)
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


class _Input:
    """The call's tensors of one dtype (1-D, contiguous), as one run of elements, without
    concatenating them."""

    def __init__(self, parts: List):
        self.parts = parts
        self.starts = list(itertools.accumulate([p.numel() for p in parts], initial=0))
        self.numel = self.starts[-1]
        self.dtype = parts[0].dtype
        self.itemsize = parts[0].element_size()

    def copy_into(self, out, start: int, stop: int) -> None:
        """Elements ``[start, stop)`` of the run into ``out`` (1-D, ``stop - start``)."""
        i = bisect.bisect_right(self.starts, start) - 1
        written = 0
        while start < stop:
            end = min(stop, self.starts[i + 1])
            if end > start:
                at = start - self.starts[i]
                out[written:written + end - start].copy_(self.parts[i][at:at + end - start])
                written += end - start
                start = end
            i += 1

    def empty(self):
        import torch

        return torch.empty(self.numel, dtype=self.dtype)


class _Result:
    """Where one replica's all_reduce puts its result: the result file the call uses (of
    the group's pool), mapped shared while the replicas reduce into it, then copy-on-write
    as the result; or, where there is none (small, or no room), a tensor the result is
    copied into."""

    def __init__(self, pool: Optional["_Pool"]):
        self.pool = pool
        self.shared = None  # the result file as a tensor, while the replicas reduce into it
        self.copied = None  # the tensor of a result copied out
        self._file: Optional[_File] = None

    def open(self, flat: _Input) -> None:
        """Take the call's result file if it has one; else make a tensor for a copy."""
        import torch

        self._file = self.pool.take() if self.pool is not None else None
        if self._file is None:
            self.copied = flat.empty()
            return
        self.shared = torch.frombuffer(self._file.shared, dtype=flat.dtype,
                                       count=flat.numel)

    def piece(self, lo: int, hi: int):
        return self.shared[lo:hi]

    def tensor(self, flat: _Input):
        """The result: the copy, or the result file mapped copy-on-write (XLA writing
        into its buffer writes into pages of its own); the file is this replica's until
        that mapping is gone."""
        import torch

        if self._file is None:
            return self.copied if self.copied is not None else flat.empty()
        self.shared = None
        mine = self.pool.own(self._file, flat.numel * flat.itemsize)
        self._file = None
        return torch.frombuffer(mine, dtype=flat.dtype)  # (it keeps the mapping alive)

    def close(self) -> None:
        """After an interrupt: a result file taken and not made a result is free again."""
        self.shared = None
        if self._file is not None:
            self.pool.free(self._file.index)
            self._file = None


class _File:
    """A result file of the pool, as this replica has it open: mapped shared, for good."""

    def __init__(self, index: int, generation: int, path: str, nbytes: int):
        self.index, self.generation = index, generation
        self.fd = os.open(path, os.O_RDWR)
        self.shared = mmap.mmap(self.fd, nbytes)

    def close(self) -> None:
        _close_map(self.shared)
        os.close(self.fd)


class _Pool:
    """The group's result files, reused from call to call (a new file costs replica 0 its
    allocation, and every replica a page fault per page of its piece).

    A file is free once no replica holds a result mapped from it (each replica's mark in
    the group's table, cleared when its result's mapping is gone). Replica 0 chooses the
    call's file before the call's first barrier: a free one of the call's size; else a new
    one (in place of a free one of another size, or an unused place), where
    :func:`room_for_result`; else none, and the result is copied out. The others read its
    choice after that barrier, and open a file they have not opened yet by its name, which
    goes at the call's last barrier."""

    def __init__(self, slots: mmap.mmap, rank: int, world: int, directory: str):
        import torch

        # [chosen place, then each place's generation and size]; [place, rank]: holds it
        self._table = torch.frombuffer(slots, dtype=torch.int64, count=1 + 2 * POOL_FILES)
        self._busy = torch.frombuffer(slots, dtype=torch.uint8, count=POOL_FILES * world,
                                      offset=_BUSY_OFFSET).view(POOL_FILES, world)
        self.rank, self.directory = rank, directory
        self._files: Dict[int, _File] = {}  # place -> this replica's open file
        self._new: Optional[tuple] = None  # (place, path) of the file made for this call
        self.made = 0  # files made, on replica 0: the next one's generation
        self.taken = 0  # calls whose result came through a file, on every replica (as well)

    def _path(self, generation: int) -> str:
        return os.path.join(self.directory, f"result-{generation}")

    def choose(self, nbytes: int) -> None:
        """Replica 0: the call's file, in the table (-1: none)."""
        table = self._table
        free = [k for k in range(POOL_FILES) if not bool(self._busy[k].any())]
        if self._new is not None:  # made by a call cut short: maybe not every replica has
            table[2 + 2 * self._new[0]] = 0  # it open, and its name goes: unused again
            self.unlink_new()
        free_sizes = [int(table[2 + 2 * k]) for k in free]
        chosen = next((k for k, size in zip(free, free_sizes) if size == nbytes), -1)
        if chosen < 0 and free and room_for_result(self.directory, nbytes):
            unused = [k for k, size in zip(free, free_sizes) if size == 0]
            place = (unused or free)[0]
            path = self._path(self.made)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:  # every page now: one first touched on a full /dev/shm is a SIGBUS
                os.posix_fallocate(fd, 0, nbytes)
                table[1 + 2 * place], table[2 + 2 * place] = self.made, nbytes
                chosen, self._new = place, (place, path)
                self.made += 1
            except OSError:
                os.unlink(path)
            finally:
                os.close(fd)
        table[0] = chosen

    def take(self) -> Optional[_File]:
        """Every replica, after the first barrier: the call's file (opened if new to this
        replica), marked as held by this replica; or None."""
        place = int(self._table[0])
        if place < 0:
            return None
        generation, nbytes = int(self._table[1 + 2 * place]), int(self._table[2 + 2 * place])
        file = self._files.get(place)
        if file is None or file.generation != generation:
            if file is not None:
                file.close()
            file = self._files[place] = _File(place, generation, self._path(generation),
                                              nbytes)
        self._busy[place, self.rank] = 1
        self.taken += 1
        return file

    def own(self, file: _File, nbytes: int) -> mmap.mmap:
        """``file`` mapped copy-on-write: this replica's result, holding the file until it
        is gone."""
        mine = mmap.mmap(file.fd, nbytes, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
        done = weakref.finalize(mine, self.free, file.index)
        done.atexit = False
        return mine

    def free(self, place: int) -> None:
        if self._busy is not None:  # (a result may outlive its group)
            self._busy[place, self.rank] = 0

    def unlink_new(self) -> None:
        """At the call's last barrier (every replica has opened its file): the name of a
        file made for it goes."""
        if self._new is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._new[1])
            self._new = None

    def close(self) -> None:
        self._table = self._busy = None
        for file in self._files.values():
            file.close()
        self._files = {}
        self.unlink_new()  # (an interrupted call's)


def _close_map(shared: mmap.mmap) -> None:
    """Unmap ``shared`` now, or, if a tensor still views it (one an interrupted collective
    left in a traceback's frame), once that tensor is gone."""
    with contextlib.suppress(BufferError):
        shared.close()


def _table_bytes(world: int) -> int:
    """The size of a group's table: whole pages (the slots after it stay page-aligned)."""
    return -(-(_BUSY_OFFSET + POOL_FILES * world) // mmap.PAGESIZE) * mmap.PAGESIZE


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
