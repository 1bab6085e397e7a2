"""Which processes colab_xla started, kept on disk, so that leftovers can be found later.

A run records the processes it starts in a file of a private per-user directory, and
removes the file when every one of them is gone. If the notebook's process dies first
(killed, out of memory) the file stays; a later run, or ``%xla_doctor``, finds the
processes still alive and offers to kill them. A process is only ever identified by pid
*and* start time, so a recycled pid is never mistaken for ours.

The directory is ``$TMPDIR/colab_xla-<uid>``, created mode 0700 and refused if someone
else owns it or can write to it (a predictable path another user could pre-create).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional

import psutil

_state_dir: Optional[str] = None


class UnsafeStateDir(RuntimeError):
    pass


def state_dir() -> str:
    """The private per-user directory (made on first use)."""
    global _state_dir
    if _state_dir is None:
        path = os.path.join(tempfile.gettempdir(), f"colab_xla-{os.getuid()}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        info = os.lstat(path)
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                or stat.S_IMODE(info.st_mode) & 0o077):
            raise UnsafeStateDir(
                f"{path} is not a private directory of this user (owner, mode or a link); "
                "colab_xla will not use it. Remove it, or set TMPDIR to a private directory.")
        _state_dir = path
    return _state_dir


def _subdir(name: str) -> str:
    path = os.path.join(state_dir(), name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return path


def _identity(proc: psutil.Process) -> List[float]:
    return [proc.pid, proc.create_time()]


def _alive(pid: int, created: float) -> Optional[psutil.Process]:
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def kernel_key() -> str:
    """This notebook process, as pid and start time."""
    me = psutil.Process()
    return f"{me.pid}-{me.create_time():.2f}"


def _kernel_alive(key: str) -> bool:
    pid, created = key.split("-", 1)
    return _alive(int(pid), float(created)) is not None


class RunRecord:
    """The file of one run: rewritten whenever the run learns of a new process."""

    def __init__(self, run_id: str):
        self.path = os.path.join(_subdir("runs"), f"{kernel_key()}-{run_id}.json")
        self._processes: Dict[int, List[float]] = {}

    def add(self, proc: psutil.Process) -> None:
        if proc.pid in self._processes:
            return
        with contextlib.suppress(psutil.Error):
            self._processes[proc.pid] = _identity(proc)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"kernel": kernel_key(), "processes": list(self._processes.values())}, f)
            os.replace(tmp, self.path)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclass(frozen=True)
class Leftover:
    pid: int
    created: float
    kernel: str  # "pid-starttime" of the notebook process that started it
    cmdline: str

    def describe(self) -> str:
        return f"pid {self.pid} ({self.cmdline[:60]}), started by notebook process {self.kernel.split('-')[0]}"


def leftovers() -> List[Leftover]:
    """Processes of earlier runs whose notebook process is gone, still alive. Records
    with nothing alive are removed."""
    found = []
    runs = _subdir("runs")
    for name in os.listdir(runs):
        path = os.path.join(runs, name)
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if _kernel_alive(record["kernel"]):
            continue  # a run going on in another notebook: not ours to judge
        alive = [proc for proc in (_alive(int(pid), created)
                                   for pid, created in record["processes"]) if proc]
        if not alive:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                found.append(Leftover(proc.pid, proc.create_time(), record["kernel"],
                                      " ".join(proc.cmdline())))
    return found


def kill_leftovers() -> List[Leftover]:
    """SIGKILL the leftovers (each checked again by pid and start time); return them."""
    killed, procs = [], []
    for left in leftovers():
        proc = _alive(left.pid, left.created)
        if proc is not None:
            with contextlib.suppress(psutil.Error):
                proc.kill()
                killed.append(left)
                procs.append(proc)
    psutil.wait_procs(procs, timeout=3)
    leftovers()  # removes the records that are now empty
    return killed


# --- full logs -------------------------------------------------------------------------------

# Full logs of the last runs stay readable after them; older ones are removed, and so are
# those of notebook processes that are gone.
KEEP_LOGS_OF_RUNS = 10
_run_number = 0


def new_log_dir() -> str:
    """A directory for one run's full logs, under this notebook process's own."""
    global _run_number
    logs = _subdir("logs")
    mine = os.path.join(logs, kernel_key())
    if _run_number == 0:
        for name in os.listdir(logs):
            if name != kernel_key() and not _kernel_alive(name):
                shutil.rmtree(os.path.join(logs, name), ignore_errors=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(mine, 0o700)
    _run_number += 1
    path = os.path.join(mine, f"run-{_run_number:05d}")
    os.mkdir(path, 0o700)
    for old in sorted(os.listdir(mine))[:-KEEP_LOGS_OF_RUNS]:
        shutil.rmtree(os.path.join(mine, old), ignore_errors=True)
    return path
