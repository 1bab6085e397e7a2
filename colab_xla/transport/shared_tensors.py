"""Large CPU tensors from the replicas to the notebook through shared memory.

A replica's value (``-o``) or pulled name (``--pull``) may hold tensors of hundreds of MiB
(a model's state). Pickled inline, each would be copied into bytes, written out, read
back and copied again. Instead, a replica writes every CPU tensor of at least
:data:`MIN_BYTES` into its own file in the run's directory in ``/dev/shm`` (one copy, by
``pwrite``), and the pickle carries only the file's name. The notebook maps the file:
the tensor it gets *is* that memory, with no further copy.

The directory belongs to the notebook's process (mode 0700, named after its pid), and is
removed when the run ends; tensors already mapped outlive it. Directories left by a
notebook process that died are removed by the next run. Where ``/dev/shm`` is missing or
full, tensors are pickled inline, as smaller ones always are.

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

import ctypes
import errno
import itertools
import mmap
import os
import shutil
from typing import Optional, Tuple

# Smaller tensors are pickled inline: a file and a mapping cost more than copying them.
MIN_BYTES = 1 << 20
SHM_ROOT = "/dev/shm"

_names = itertools.count()


def _prefix() -> str:
    return f"colab_xla-{os.getuid()}-"


def make_dir(run_id: str, root: str = SHM_ROOT) -> Optional[str]:
    """The notebook side: a private directory for one run's tensors, or None where
    shared memory is not available (then every tensor is pickled inline)."""
    if not os.path.isdir(root):
        return None
    prune(root)
    path = os.path.join(root, f"{_prefix()}{os.getpid()}-{run_id}")
    try:
        os.mkdir(path, 0o700)
    except OSError:
        return None
    return path


def remove_dir(path: Optional[str]) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def prune(root: str = SHM_ROOT) -> None:
    """Remove the directories of notebook processes of this user that are gone."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(_prefix()):
            continue
        pid = name[len(_prefix()):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


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
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
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
    os.close(fd)
    return rebuild, (path, str(tensor.dtype).rsplit(".", 1)[1], tuple(tensor.shape), nbytes)


def rebuild(path: str, dtype: str, shape: Tuple[int, ...], nbytes: int):
    """The notebook side: the tensor, mapped from its file (which is then removed)."""
    torch = _torch()
    fd = os.open(path, os.O_RDWR)
    try:
        memory = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping keeps the memory until the tensor is freed
    flat = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _torch():
    import torch

    return torch
