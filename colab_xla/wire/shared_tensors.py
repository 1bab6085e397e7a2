"""Large CPU tensors from the replicas to the notebook through shared memory.

A replica's value (``-o``) or pulled name (``--pull``) may hold tensors of hundreds of MiB
(a model's state). Pickled inline, each would be copied into bytes, written out, read
back and copied again. Instead, a replica writes every CPU tensor of at least
:data:`MIN_BYTES` into its own file in the run's directory in ``/dev/shm`` (one copy, by
``pwrite``), and the pickle carries only the file's name. The notebook maps the file:
the tensor it gets *is* that memory, with no further copy.

The run's directory lies in the notebook process's own directory of ``/dev/shm``
(``colab_xla-UID-PID-XXXXXXXX``: a random name, made mode 0700, so another user can plant
nothing in it first), and is removed when the run ends; tensors already mapped outlive it.
Directories left by a notebook process that died are removed by the next run. Where
``/dev/shm`` is missing or full, tensors are pickled inline, as smaller ones always are.

Pages are reused: new shared-memory pages cost the kernel about as much as the copy into
them. A mapped tensor's file moves to the notebook process's page directory
(``pages`` in its own directory), and when the notebook frees the tensor its file is kept
there as free pages (up to :data:`POOL_FRACTION` of the machine's memory in all), which
the next replicas' tensors of the same size or up to twice it are written into. Pages
are not kept if a process forked by the notebook after they were mapped is still alive
(it may still see them), and the directory goes when the notebook's process exits;
:func:`drop_free_pages` gives them back at once.

A replica process that runs many cells (a session's, after :func:`keep_mappings`) also
keeps a mapping of each file it wrote, made once its cell has ended
(:func:`map_written`): when it claims that file again, its page tables exist, and the
write is a plain memory copy (faster than ``pwrite`` into tmpfs: ``bench/result_return.py``).
It lets go of the mappings of files the notebook removed when its cell ends, and between
cells every :data:`KEPT_CHECK_SECONDS`; a process it forks (a DataLoader worker) does not
inherit these mappings.

Example::

    >>> import pickle, torch
    >>> shm = make_dir("doctest")
    >>> big = torch.arange(1 << 19, dtype=torch.float32)          # 2 MiB
    >>> pickled = pickle.dumps(reduce_tensor(big, shm))           # a name, not the data
    >>> len(pickled) < 1000, torch.equal(rebuild(*pickle.loads(pickled)[1]), big)
    (True, True)
    >>> remove_dir(shm)
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import itertools
import mmap
import os
import shutil
import stat
import threading
import time
import weakref
from typing import Dict, List, NamedTuple, Optional, Tuple

# Smaller tensors are pickled inline: a file and a mapping cost more than copying them.
MIN_BYTES = 1 << 20
SHM_ROOT = "/dev/shm"
# Freed results' pages kept for the next ones: at most this share of physical memory.
POOL_FRACTION = 1 / 8

# How often a session's idle replica lets go of kept mappings whose file the notebook removed.
KEPT_CHECK_SECONDS = 2.0
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.13

# How often make_dir looks for the directories of notebook processes that are gone (prune).
PRUNE_SECONDS = 60.0
_pruned: Dict[str, float] = {}  # root -> when make_dir last pruned it (time.monotonic())

_names = itertools.count()
# root -> (pid, this process's own directory in it): made once, removed at exit.
_own: Dict[str, Tuple[int, str]] = {}


class _Kept(NamedTuple):
    fd: int
    memory: mmap.mmap
    address: int


# The replica side, in a process that keeps mappings (see keep_mappings): by inode.
_kept: Dict[int, _Kept] = {}
_to_map: List[int] = []  # the files written in the current cell (their descriptors)
_kept_lock = threading.Lock()
_keeping: Optional[int] = None  # the pid of the process that keeps them (not its children)


# This user's names' start (os.getuid() is a system call: asked once).
_PREFIX = f"colab_xla-{os.getuid()}-"
_PAGES = "pages"


def make_dir(run_id: str, root: str = SHM_ROOT) -> Optional[str]:
    """The notebook side: a private directory for one run's tensors, or None where
    shared memory is not available (then every tensor is pickled inline). It runs for
    every warm session cell: one ``mkdir`` then, besides a prune a minute."""
    now = time.monotonic()
    if now - _pruned.get(root, -PRUNE_SECONDS) >= PRUNE_SECONDS:  # (not at every warm cell)
        _pruned[root] = now
        prune(root)
    try:
        path = os.path.join(own_dir(root), f"run-{run_id}")
        os.mkdir(path, 0o700)
    except OSError:  # (no such root, say)
        return None
    return path


def own_dir(root: str = SHM_ROOT) -> str:
    """This process's own directory in ``root``, made on first use (a random name at 0700:
    what is in it was put there by this user), with its page directory; removed when the
    process exits. Raises OSError where it cannot be made."""
    pid = os.getpid()
    mine = _own.get(root)
    if mine is None or mine[0] != pid or not os.path.isdir(mine[1]):
        import tempfile

        path = tempfile.mkdtemp(prefix=f"{_PREFIX}{pid}-", dir=root)
        with contextlib.suppress(OSError):  # no page reuse without it: tensors work as before
            os.mkdir(os.path.join(path, _PAGES), 0o700)
        atexit.register(_remove_own, path, pid)
        mine = _own[root] = (pid, path)
    return mine[1]


def make_private_dir(kind: str, root: str = SHM_ROOT) -> str:
    """A new private directory in ``root`` for this process's ``kind`` of files, removed
    by :func:`prune` once this process is gone if its owner did not remove it."""
    import tempfile

    return tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-{kind}-", dir=root)


def pages_dir(directory: str) -> Optional[str]:
    """The page directory of the notebook process whose run directory is ``directory``
    (None if ``directory`` is not one: then pages are not reused)."""
    parent, name = os.path.split(os.path.normpath(directory))
    if not (name.startswith("run-") and os.path.basename(parent).startswith(_PREFIX)):
        return None
    return os.path.join(parent, _PAGES)


def own_pages_dir(root: str = SHM_ROOT) -> str:
    """This process's page directory (where the pages of its freed results are kept)."""
    return os.path.join(own_dir(root), _PAGES)


def drop_free_pages(root: str = SHM_ROOT) -> int:
    """Give back the free pages this process keeps for its next results; the bytes freed.
    (A session's replicas let go of their own mappings of them within
    :data:`KEPT_CHECK_SECONDS`.)"""
    mine = _own.get(root)
    if mine is None or mine[0] != os.getpid():
        return 0  # none made here
    pages = os.path.join(mine[1], _PAGES)
    freed = 0
    for size, name in map(_free_size, os.listdir(pages) if os.path.isdir(pages) else ()):
        if size >= 0:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(pages, name))
                freed += size
    return freed


def _remove_own(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not a forked replica that ran atexit
        remove_dir(path)


def remove_dir(path: Optional[str]) -> None:
    if path:
        try:
            os.rmdir(path)  # (most runs' directory is empty by now: one call, not rmtree's walk)
        except OSError:
            shutil.rmtree(path, ignore_errors=True)


def prune(root: str = SHM_ROOT) -> None:
    """Remove the directories of notebook processes of this user that are gone (only
    directories this user owns: a name another user planted is not followed or touched)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISDIR(info.st_mode) and info.st_uid == uid:
                    shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has that pid now
        return True
    return True


def reduce_tensor(tensor, directory: Optional[str]) -> Optional[Tuple]:
    """The replica side: ``(rebuild, args)`` for a CPU tensor written to ``directory``,
    or None to pickle it inline (small, not a plain dense tensor, or no room)."""
    torch = _torch()
    if (directory is None or tensor.device.type != "cpu" or tensor.layout != torch.strided
            or tensor.is_quantized or tensor.requires_grad or type(tensor) is not torch.Tensor):
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < MIN_BYTES:
        return None
    data = tensor.detach().contiguous()
    path = os.path.join(directory, f"{os.getpid()}-{next(_names)}")
    try:
        claimed = _claim(directory, nbytes, path)  # pages a freed result left: no new pages
        if claimed:
            fd = os.open(path, os.O_RDWR)
            os.ftruncate(fd, nbytes)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        if not (claimed and _copy_into_kept(fd, data.data_ptr(), nbytes)):
            view = memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")
            written = 0
            while written < nbytes:  # a write to tmpfs may be partial; a full one is ENOSPC
                written += os.pwrite(fd, view[written:], written)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            return None  # /dev/shm is full: this one goes inline
        raise
    if _keeping_here():
        with _kept_lock:
            _to_map.append(fd)  # mapped once the cell has ended (or closed, if kept already)
    else:
        os.close(fd)
    return rebuild, (path, str(tensor.dtype).rsplit(".", 1)[1], tuple(tensor.shape), nbytes)


def keep_mappings() -> None:
    """In a replica process that runs many cells: keep a mapping of every file it writes
    (see :func:`map_written`), so that writing the same pages again is a memory copy."""
    global _keeping
    _keeping = os.getpid()


def _keeping_here() -> bool:
    return _keeping == os.getpid()  # a child forked from it has no mappings (MADV_DONTFORK)


def _copy_into_kept(fd: int, address: int, nbytes: int) -> bool:
    """Copy ``nbytes`` from ``address`` into the file ``fd`` through this process's kept
    mapping of it; False if it has none (or one too short)."""
    if not _keeping_here():
        return False
    with _kept_lock:
        kept = _kept.get(os.fstat(fd).st_ino)
    if kept is None or len(kept.memory) < nbytes:
        return False
    ctypes.memmove(kept.address, address, nbytes)
    return True


def map_written() -> None:
    """The replica side, once its cell has ended: let go of the kept mappings of files the
    notebook removed (first: the process never maps more than the files it may claim),
    then map the files it wrote in the cell and populate their page tables (off the cell's
    time)."""
    let_go_removed()
    with _kept_lock:
        fds, _to_map[:] = list(_to_map), []
    for fd in fds:
        kept = None
        try:
            st = os.fstat(fd)
            with _kept_lock:
                known = st.st_ino in _kept
            if not known and st.st_nlink and st.st_size:
                memory = mmap.mmap(fd, st.st_size)
                try:
                    memory.madvise(MADV_POPULATE_WRITE)
                    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
                except (OSError, ValueError):  # an older kernel: faults would cost more
                    memory.close()
                else:
                    kept = _Kept(fd, memory, address)
                    with contextlib.suppress(OSError, AttributeError):
                        # a process the replica forks (a DataLoader worker) would keep the
                        # pages of removed files alive as long as it lives
                        memory.madvise(mmap.MADV_DONTFORK)
        except OSError:
            pass
        if kept is None:
            os.close(fd)
            continue
        with _kept_lock:
            _kept[st.st_ino] = kept


def let_go_removed() -> None:
    """The replica side: drop the kept mappings of files the notebook removed (their pages
    are freed only when no process maps them)."""
    with _kept_lock:
        for inode, kept in list(_kept.items()):
            try:
                removed = os.fstat(kept.fd).st_nlink == 0
            except OSError:
                removed = True
            if removed:
                del _kept[inode]
                kept.memory.close()
                os.close(kept.fd)


def _claim(directory: str, nbytes: int, path: str) -> bool:
    """The replica side: move a free file of ``nbytes`` to ``2 * nbytes`` bytes from the
    notebook's page directory to ``path``; False if there is none."""
    pages = pages_dir(directory)
    try:
        names = os.listdir(pages) if pages else []
    except OSError:
        return False
    fits = sorted((_not_kept(pages, name), size, name) for size, name in map(_free_size, names)
                  if nbytes <= size <= 2 * nbytes)
    for _, _, name in fits:  # kept mapped here, then the smallest; another replica may take it
        try:
            os.rename(os.path.join(pages, name), path)
            return True
        except OSError:
            continue
    return False


def _not_kept(pages: str, name: str) -> bool:
    if not _keeping_here():
        return True
    try:
        inode = os.stat(os.path.join(pages, name)).st_ino
    except OSError:
        return True
    with _kept_lock:
        return inode not in _kept


def _free_size(name: str) -> Tuple[int, str]:
    """``free-SIZE-N`` -> ``(SIZE, name)``; -1 for the other files."""
    parts = name.split("-")
    return (int(parts[1]) if len(parts) == 3 and parts[0] == "free" and parts[1].isdigit()
            else -1), name


def rebuild(path: str, dtype: str, shape: Tuple[int, ...], nbytes: int):
    """The notebook side: the tensor, mapped from its file (which then moves to the
    page directory, or is removed)."""
    torch = _torch()
    fd = os.open(path, os.O_RDWR)
    try:
        memory = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        held = _hold(path)
        if held is None:
            os.unlink(path)  # the mapping keeps the memory until the tensor is freed
    if held is not None:
        weakref.finalize(memory, _release, held, nbytes, os.getpid(),
                         _boot_ticks()).atexit = False
    flat = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _hold(path: str) -> Optional[str]:
    pages = pages_dir(os.path.dirname(path))
    if pages is None:
        return None
    held = os.path.join(pages, f"held-{os.getpid()}-{next(_names)}")
    try:
        os.rename(path, held)
    except OSError:
        return None
    return held


def _release(held: str, nbytes: int, owner: int, mapped_at: int) -> None:
    """The notebook freed the tensor mapped from ``held``: keep its pages for the next
    results, or remove the file."""
    try:
        if os.getpid() != owner:  # a forked replica letting go of its copy of the mapping
            return
        pages = os.path.dirname(held)
        kept = sum(max(0, _free_size(name)[0]) for name in os.listdir(pages))
        if kept + nbytes > POOL_FRACTION * _physical_bytes() or _forked_since(mapped_at):
            os.unlink(held)
        else:
            os.rename(held, os.path.join(pages, f"free-{nbytes}-{next(_names)}"))
    except OSError:
        pass  # the page directory is gone (the process is exiting): nothing to keep


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat gives a start time in."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _forked_since(ticks: int) -> bool:
    """Whether a child of this process that started at ``ticks`` or later (or one whose
    start cannot be read) is alive: a forked child maps what this process mapped."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                children = f.read().split()
        except OSError:
            return True
        for pid in children:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    started = int(f.read().rsplit(")", 1)[1].split()[19])
            except (OSError, ValueError, IndexError):
                continue  # ended meanwhile
            if started >= ticks - 1:
                return True
    return False


def _torch():
    import torch

    return torch
