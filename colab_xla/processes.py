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
