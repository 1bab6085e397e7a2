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
import ctypes
import json
import os
import signal
import sys
from dataclasses import dataclass
from typing import Dict, List

import psutil

from . import state


def _identity(proc: psutil.Process) -> List[float]:
    return [proc.pid, proc.create_time()]


class RunRecord:
    """The file of one run: rewritten whenever the run learns of a new process."""

    def __init__(self, run_id: str):
        self.path = os.path.join(state.subdir("runs"), f"{state.kernel_key()}-{run_id}.json")
        self._processes: Dict[int, List[float]] = {}

    def add(self, proc: psutil.Process) -> None:
        if proc.pid in self._processes:
            return
        with contextlib.suppress(psutil.Error):
            self._processes[proc.pid] = _identity(proc)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"kernel": state.kernel_key(), "processes": list(self._processes.values())}, f)
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
    runs = state.subdir("runs")
    for name in os.listdir(runs):
        path = os.path.join(runs, name)
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if state.kernel_alive(record["kernel"]):
            continue  # a run going on in another notebook: not ours to judge
        alive = [proc for proc in (state.process_alive(int(pid), created)
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
        proc = state.process_alive(left.pid, left.created)
        if proc is not None:
            with contextlib.suppress(psutil.Error):
                proc.kill()
                killed.append(left)
                procs.append(proc)
    psutil.wait_procs(procs, timeout=3)
    leftovers()  # removes the records that are now empty
    return killed


# --- how a process started for a run ends with it ---------------------------------------------

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Make this replica process the parent of every orphan among its descendants (Linux).

    ``os.system('server &')`` or a double fork leaves a process whose parent has exited:
    it would go to init and out of reach. Adopted, it stays a descendant of the replica,
    which the run ends with everything else it started.
    """
    if sys.platform.startswith("linux"):
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end_descendants() -> None:
    """SIGKILL every process this one started, and their own (by pid, never by name).

    Called when the last replica of the process has finished its cell: a subprocess, a
    forked child or a DataLoader worker the cell left running must not outlive the run,
    however short it was (the notebook's own clean-up comes after this process has gone,
    when its orphans would no longer be found).
    """
    import psutil

    victims = psutil.Process().children(recursive=True)
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    psutil.wait_procs(victims, timeout=3)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the notebook's process dies (Linux), so no replica
    outlives a kernel restart holding a TPU."""
    if sys.platform.startswith("linux"):
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
