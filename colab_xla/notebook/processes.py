"""The processes colab_xla starts: tracked, killed with their run, never left behind.

* :class:`RunProcesses` follows one run's processes from the notebook, by pid as they
  appear, and kills them all when the run ends.
* The pid registry keeps them on disk: a run records its processes in a file of the
  private state directory (:mod:`colab_xla.notebook.state`) and removes it when every one is gone.
  If the notebook's process dies first (killed, out of memory) the file stays; a later
  run, or ``%xla_doctor``, finds those still alive and offers to kill them. A process is
  only ever identified by pid *and* start time, so a recycled pid is never mistaken for
  ours.
* How a process started for a run ends with the notebook's process, or with its
  replica, is :mod:`colab_xla.wire.lifetime` (the replicas call it too).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import psutil

from . import state


# When a SIGKILL is put down to memory (RunProcesses.memory_note).
LOW_MEMORY_FRACTION = 0.1
LARGE_PROCESS_FRACTION = 0.5


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f}"


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
            with open(tmp, "w", opener=state.private_file) as f:
                json.dump({"kernel": state.kernel_key(),
                           "processes": list(self._processes.values())}, f)
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
        return (f"pid {self.pid} ({self.cmdline[:60]}), started by notebook process "
                f"{self.kernel.split('-')[0]}")


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


# --- the processes of one run, seen from the notebook ------------------------------------------


class RunProcesses:
    """Every process one run started: the pool's replica processes and what they started
    (a DataLoader's workers, a subprocess in its own session), tracked by pid as they
    appear, recorded in the pid registry, and killed together when the run ends.

    Once reaped, a pool's process is kept as its exit code only: its ``multiprocessing``
    object holds its sentinel's pipe (two fds) for as long as anything refers to it, and
    this object can outlive its run by far (a session's, held by the traceback of the cell
    that saw a replica die: ``sys.last_traceback``, until the next error)."""

    def __init__(self, run_id: str):
        self._record = RunRecord(run_id)
        self._tracked: Dict[int, psutil.Process] = {}
        # (weak: the children of other runs that were running then are theirs to let go)
        self._children_before: weakref.WeakSet = weakref.WeakSet()
        self._children: Dict[int, multiprocessing.process.BaseProcess] = {}  # not reaped
        self._exit_codes: Dict[int, int] = {}  # pid -> exit code, of those reaped
        self._adopting = True
        self._rss: Dict[int, int] = {}  # pid -> resident memory at the last look
        self._machine: Optional[Tuple[int, int]] = None  # (available, total) then

    def begin(self) -> None:
        """Call just before the run starts processes: every child of the notebook's
        process that appears from now on is the run's (until :meth:`stop_adopting`)."""
        self._children_before = weakref.WeakSet(multiprocessing.active_children())

    def stop_adopting(self) -> None:
        """Every process of the run has started: children of the notebook's process that
        appear later are not its (a session's, while other runs and the lock manager
        start theirs). What its processes start is still tracked as theirs."""
        self.new_children()
        self._adopting = False

    def new_children(self) -> List[multiprocessing.process.BaseProcess]:
        """Processes started since the run began (the pool's) and still running;
        remembered, so that their exit codes can be told after they are reaped."""
        for p in multiprocessing.active_children() if self._adopting else ():
            if p not in self._children_before and p.pid not in self._exit_codes:
                self._children.setdefault(p.pid, p)
        running = []
        for pid, p in list(self._children.items()):
            if p.exitcode is None:  # (asks waitpid: reaps one that is gone)
                running.append(p)
            else:
                self._let_go(pid, p)
        return running

    def _let_go(self, pid: int, process: multiprocessing.process.BaseProcess) -> None:
        """``process`` is reaped: keep its exit code, not the object."""
        process.join(0)  # (out of multiprocessing's own list of children too)
        self._exit_codes[pid] = process.exitcode
        del self._children[pid]

    def exit_codes(self) -> List[int]:
        """The non-zero exit codes of the pool's processes that have ended (a negative
        code is the signal that killed it)."""
        self.new_children()
        return sorted({code for code in self._exit_codes.values() if code})

    def track(self, pid: int) -> None:
        if pid not in self._tracked:
            with contextlib.suppress(psutil.Error):
                self._tracked[pid] = psutil.Process(pid)
                self._record.add(self._tracked[pid])

    def track_descendants(self) -> None:
        """Record the pool's processes and what they started: all killed with the run,
        all in the pid registry."""
        for child in self.new_children():
            self.track(child.pid)
        for pid in _descendants([pid for pid, process in self._tracked.items()
                                 if process.is_running()]):
            self.track(pid)
        self._look_at_memory()

    def _look_at_memory(self) -> None:
        # What a SIGKILL is judged by (memory_note): the kernel's log, which names the
        # out-of-memory killer's victims, is not readable here.
        for pid, process in self._tracked.items():
            with contextlib.suppress(psutil.Error):
                self._rss[pid] = process.memory_info().rss
        machine = psutil.virtual_memory()
        self._machine = (machine.available, machine.total)

    def memory_note(self, pid: Optional[int]) -> Optional[str]:
        """If memory was high at the last look (a tick before): says so, and that the
        kernel's out-of-memory killer is the likely cause of a SIGKILL; else None. High:
        less than :data:`LOW_MEMORY_FRACTION` of the machine's memory available, or the
        process ``pid`` holding more than :data:`LARGE_PROCESS_FRACTION` of it."""
        if self._machine is None:
            return None
        available, total = self._machine
        rss = self._rss.get(pid, 0) if pid is not None else 0
        if available >= LOW_MEMORY_FRACTION * total and rss <= LARGE_PROCESS_FRACTION * total:
            return None
        held = f"its process held {_gib(rss)} GiB, " if rss else ""
        return (f"memory was high ({held}{_gib(available)} of {_gib(total)} GiB free a "
                "moment before): most likely the kernel's out-of-memory killer. Use less "
                "memory per replica (a smaller batch or model, or fewer replicas)")

    def kill(self) -> None:
        """SIGKILL every process of the run (by pid, never by name) and reap them."""
        children = self.new_children()
        for child in children:
            self.track(child.pid)
        # (What a process that has ended started was tracked while it ran, or went to its
        # replica, the subreaper: only the running ones are looked under.)
        victims = [process for process in self._tracked.values() if process.is_running()]
        for pid in _descendants([process.pid for process in victims]):
            with contextlib.suppress(psutil.Error):
                victims.append(psutil.Process(pid))
        for victim in victims:
            with contextlib.suppress(psutil.Error):
                victim.kill()  # psutil refuses if the pid now belongs to another process
        # The pool's processes are reaped by multiprocessing, not by psutil: a child that
        # psutil's waitpid reaped stays in multiprocessing's own list for good (its poll
        # sees ECHILD as "still running"), and with it the pipe fd of its sentinel - one
        # leaked fd per replica process of every interrupted or timed-out run.
        deadline = time.monotonic() + 3
        for child in children:
            child.join(max(0.0, deadline - time.monotonic()))
        ours = {child.pid for child in children}
        gone, alive = psutil.wait_procs([p for p in victims if p.pid not in ours],
                                        timeout=max(0.0, deadline - time.monotonic()))
        alive += self.new_children()  # (the reaped ones let go of)
        self._tracked.clear()
        if not alive:
            self._record.close()

    def kill_until_ended(self, starter: threading.Thread, seconds: float) -> None:
        """Kill until ``starter`` (the thread that starts the processes and waits for
        them) has ended, for at most ``seconds``: it may still be starting processes after
        the first kill, and none of them may outlive the run."""
        deadline = time.monotonic() + seconds
        while True:
            self.kill()
            if not starter.is_alive() or time.monotonic() >= deadline:
                return
            starter.join(0.05)


def _descendants(pids: List[int]) -> List[int]:
    """Every descendant of these processes, found in one pass over /proc, none if there are
    no ``pids`` (``Process.children`` makes a pass per process: a notebook with 8 replica
    processes read /proc 9 times a tick while output flowed, and again at every run's end,
    on a machine with many processes most of its time)."""
    if not pids:
        return []
    children: Dict[int, List[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    found, todo = [], list(pids)
    while todo:
        for pid in children.pop(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found
