"""colab_xla's state on disk: a private per-user directory holding the pid registry
(:mod:`colab_xla.notebook.processes`), the full logs of recent runs and the files of the runs and
sessions under way, each kept under the notebook process it belongs to (its pid and start
time, so a recycled pid is never mistaken for it) and removed once that process is gone.

The directory is ``$TMPDIR/colab_xla-<uid>``, made mode 0700. That name can be guessed, so
another user may have made it first: one that is not a directory of this user's at 0700 (its
owner, its mode, a link) is never used. colab_xla then takes, and says so once, a private
place of the user's own: ``$XDG_RUNTIME_DIR/colab_xla``, else a directory
``$TMPDIR/colab_xla-<uid>-XXXXXXXX`` of a random name (one that an earlier process made, and
which is this user's at 0700, is found again by its prefix).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import sys
import tempfile
from typing import Optional

import psutil

from ..errors import SetupError

_state_dir: Optional[str] = None


class UnsafeStateDir(SetupError):
    """No private directory for colab_xla's state could be had."""


def state_dir() -> str:
    """The private per-user directory (made on first use)."""
    global _state_dir
    if _state_dir is None:
        default = os.path.join(tempfile.gettempdir(), f"colab_xla-{os.getuid()}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(default, 0o700)
        if private(default):
            _state_dir = default
        else:
            _state_dir = _elsewhere(default)
            print(f"colab_xla: {default} is not a private directory of this user (another "
                  f"user may have made it): using {_state_dir} instead. Nothing to do; to "
                  "have the usual place back, ask the machine's administrator to remove it.",
                  file=sys.stderr)
    return _state_dir


def private(path: str) -> bool:
    """Whether ``path`` is a directory (not a link to one) of this user's, which no one else
    may enter or write to."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and not stat.S_IMODE(info.st_mode) & 0o077)


def private_file(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open`: the file made mode 0600, never through a link (the
    directories are private too; this holds under a TMPDIR that is not)."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)


def _elsewhere(squatted: str) -> str:
    """A private state directory where the default one is not private."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and private(runtime):
        path = os.path.join(runtime, "colab_xla")
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        if private(path):
            return path
    parent, name = os.path.split(squatted)
    try:
        earlier = sorted(n for n in os.listdir(parent) if n.startswith(name + "-"))
    except OSError:
        earlier = []
    for candidate in earlier:
        if private(os.path.join(parent, candidate)):
            return os.path.join(parent, candidate)
    try:
        return tempfile.mkdtemp(prefix=name + "-", dir=parent)
    except OSError as exc:
        raise UnsafeStateDir(
            f"{squatted} is not a private directory of this user, and no other could be "
            f"made ({exc.strerror}): set TMPDIR to a private directory before the notebook "
            "starts, or XDG_RUNTIME_DIR.") from None


def subdir(name: str) -> str:
    """``name`` in the state directory, made mode 0700 if new."""
    path = os.path.join(state_dir(), name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return path


def process_alive(pid: int, created: float) -> Optional[psutil.Process]:
    """The process ``pid`` if it is the one started at ``created`` (a recycled pid is not)
    and has not ended; else None."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def kernel_key() -> str:
    """This notebook process, as pid and start time."""
    return _process_key(os.getpid())  # (a forked child asks for its own)


@functools.lru_cache(maxsize=None)
def _process_key(pid: int) -> str:
    return f"{pid}-{psutil.Process(pid).create_time():.2f}"


def kernel_alive(key: str) -> bool:
    """Whether the notebook process of ``key`` (see :func:`kernel_key`) is still running;
    a name that is no such key (something else put there) is taken as alive: it is not
    ours to remove."""
    pid, _, created = key.partition("-")
    try:
        return process_alive(int(pid), float(created)) is not None
    except ValueError:
        return True


# Full logs of the last runs stay readable after them; older ones are removed, and so are
# those of notebook processes that are gone.
KEEP_LOGS_OF_RUNS = 10
_run_number = 0
# (kind, this process's directory of it) once the directories of notebook processes that are
# gone were removed from beside it: a forked child, whose directory differs, sweeps again.
_swept = set()


def own_dir(kind: str) -> str:
    """This notebook process's directory of ``kind`` (``logs``, ``work``), made on first
    use, when those of notebook processes that are gone (killed before they could clean up)
    are removed. Made again if a cleaner of /tmp removed it (so it is looked for at every
    call, not cached)."""
    parent = subdir(kind)
    mine = os.path.join(parent, kernel_key())
    if (kind, mine) not in _swept:
        _swept.add((kind, mine))
        for name in os.listdir(parent):
            if name != kernel_key() and not kernel_alive(name):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(mine, 0o700)
    return mine


# A Unix socket's path is at most 107 bytes (Linux): a socket whose path in the work
# directory would be longer (a long TMPDIR) goes where its maker puts it by default.
MAX_SOCKET_PATH = 107


def fits_socket(directory: str, name: str) -> bool:
    """Whether a Unix socket named like ``name`` fits in ``directory``."""
    return len(os.path.join(directory, name).encode()) <= MAX_SOCKET_PATH


def new_work_dir(prefix: str) -> str:
    """A new directory, mode 0700, for the files of one run or one session (the cell's
    module, pipes, reports), under this notebook process's own: its owner removes it when
    done, and if the notebook process is killed first, the next one sweeps it."""
    return tempfile.mkdtemp(prefix=prefix, dir=own_dir("work"))


def new_log_dir() -> str:
    """A directory for one run's full logs, under this notebook process's own."""
    return make_log_dir(next_log_dir())


def next_log_dir() -> str:
    """Where the next run's full logs go, under this notebook process's own directory:
    made by :func:`make_log_dir` once the run has a line to log (a warm cell that prints
    nothing makes, removes and looks for no directory: no system call)."""
    global _run_number
    _run_number += 1
    return os.path.join(state_dir(), "logs", kernel_key(), f"run-{_run_number:05d}")


def make_log_dir(path: str) -> str:
    """Make ``path`` (of :func:`next_log_dir`), unless another replica's log of the run made
    it; the call that makes it removes the logs of all but the last
    :data:`KEEP_LOGS_OF_RUNS` runs that logged. This notebook process's directory of logs
    is made first if it is not there (its first log, or a cleaner of /tmp removed it)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return path
    except FileNotFoundError:
        if os.path.dirname(path) != own_dir("logs"):
            raise
        return make_log_dir(path)
    mine = os.path.dirname(path)
    for old in sorted(os.listdir(mine))[:-KEEP_LOGS_OF_RUNS]:
        shutil.rmtree(os.path.join(mine, old), ignore_errors=True)
    return path
