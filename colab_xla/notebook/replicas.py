"""Where a run's replicas come from: the :class:`Replicas` interface a
:class:`colab_xla.notebook.supervisor.Supervisor` runs its cell on, and :class:`FreshReplicas`,
a one-off run's (started for the run by :func:`colab_xla.notebook.launch.start`, every
process of it killed when it ends). A session's replicas, kept across cells, are
:class:`colab_xla.notebook.targets.session_replicas.SessionReplicas`.
"""

from __future__ import annotations

import threading
import time
from typing import List, Optional

from . import processes
from .launch import Launch, environ, run_replica, start
from .pipes import RunPipes
from ..wire import shared_tensors
from ..wire.job import ReplicaJob
from ..runtimes.plan import ReplicaPlan

# After a kill, how long to wait for the driver thread to see its pool broken (in all:
# a run that was cut is released twice, when stopped and when it ends).
_DRIVER_JOIN_SECONDS = 5.0
# How long a one-off run's replicas have to start: the processes' start-up and the
# runtime's launch (TorchTPU's may wait up to 300 s for the chips) come first.
START_SECONDS = 600.0


class Replicas:
    """The replicas a :class:`colab_xla.notebook.supervisor.Supervisor` runs its cell on, and
    their processes.

    :class:`FreshReplicas` starts them for the run and kills them after it; a session
    (:class:`colab_xla.notebook.targets.session_replicas.SessionReplicas`) sends the cell
    to replicas it keeps.
    """

    inherit = False  # whether the replicas fork from this process for the run
    # Whether a replica answers a question for its stacks (colab_xla.wire.stacks) before it
    # takes the stop, so the run need not wait for the answers before it stops them.
    answer_first = False
    running = False  # whether their processes run before the run (a session's)
    # How long every replica has to start the cell, from the run's start, before the run
    # is cut as "unstarted" (colab_xla.notebook.deadlines); None: no bound.
    start_seconds: Optional[float] = None

    def pipes(self, directory: str, processes: int) -> RunPipes:
        """The pipes the run reads (its own in ``directory``, for ``processes`` replica
        processes: made here and closed by :meth:`done_with`)."""
        return RunPipes(directory, processes)

    def done_with(self, pipes: RunPipes) -> None:
        """The run has read ``pipes`` (:meth:`pipes`) for the last time."""
        pipes.close()

    def begin(self) -> None:
        """Just before the replicas are started."""

    # Whether :meth:`drive` runs in a driver thread of its own (one-off runs: it starts
    # the processes and waits for them), or in the run's own thread (a session's: it only
    # sends the cell, and a thread started for that would cost every warm cell its start).
    threaded = True

    def drive(self, job: ReplicaJob, ended, over) -> None:
        """Run ``job`` on every replica, and call ``over()`` once every replica has ended
        it. ``ended(ordinal, code)`` tells of a replica whose process ended. In a driver
        thread (:attr:`threaded`), it returns then; else it returns once the job is sent,
        and ``over`` is called by whichever thread sees the end."""
        raise NotImplementedError

    def started(self, pid: int) -> None:
        """A replica runs in process ``pid``."""

    def finished(self, ordinal: int) -> None:
        """Replica ``ordinal`` sent its end (in time or not)."""

    def tick(self) -> None:
        """Called a few times a second while the run goes on."""

    def exit_codes(self) -> List[int]:
        return []

    def memory_note(self, pid: Optional[int]) -> Optional[str]:
        """Why process ``pid`` was likely SIGKILLed, if memory was high (see
        :meth:`colab_xla.notebook.processes.RunProcesses.memory_note`); else None."""
        return None

    def stop(self, driver: threading.Thread, read_until, why: str) -> None:
        """The run was cut for ``why`` (a reason of :class:`colab_xla.notebook.deadlines.
        Deadlines`): stop its replicas; ``read_until(t)`` reads what they send until the
        time ``t`` or the driver's end."""
        self.release(driver)

    def release(self, driver: threading.Thread) -> None:
        """The run is over, whatever happened: leave nothing of it running."""


class FreshReplicas(Replicas):
    """A one-off run's replicas: started by :func:`colab_xla.notebook.launch.start` for the run,
    every process of it killed when it ends."""

    start_seconds = START_SECONDS

    def __init__(self, run_id: str, launch: Launch, plan: ReplicaPlan):
        self.launch, self.plan = launch, plan
        self.inherit = launch.start_method == "fork"
        self.processes = processes.RunProcesses(run_id)
        self._release_by: Optional[float] = None  # when release stops waiting for the driver

    def begin(self) -> None:
        self.processes.begin()

    def done_with(self, pipes: RunPipes) -> None:
        """The run's pipes close, and what its processes left in shared memory goes with
        them: a collectives group's directory (colab_xla.runtimes.shm_collectives), which
        replica 0 removes when the group closes, not when its process ends. (Else it
        stayed, empty, until a later run's look for the directories of processes that are
        gone, at most once a minute: after the notebook's last run, for good.)"""
        super().done_with(pipes)
        shared_tensors.prune()

    def drive(self, job: ReplicaJob, ended, over) -> None:
        with environ(self.plan.env):
            start(self.launch, run_replica, job,
                  processes=self.plan.processes if self.plan.own_processes else 0,
                  ended=ended)
        over()

    def started(self, pid: int) -> None:
        self.processes.track(pid)
        self.processes.new_children()

    def tick(self) -> None:
        self.processes.track_descendants()

    def exit_codes(self) -> List[int]:
        return self.processes.exit_codes()

    def memory_note(self, pid: Optional[int]) -> Optional[str]:
        return self.processes.memory_note(pid)

    def release(self, driver: threading.Thread) -> None:
        """Kill the run's processes until the driver has seen them end: the launcher may
        still be starting replicas when the run is stopped (a short --timeout, an error
        in a view), and a process it starts after a kill must not outlive the run. A
        driver that does not end (blocked on a forkserver still importing) is waited for
        :data:`_DRIVER_JOIN_SECONDS` in all, however often this is called."""
        if self._release_by is None:
            self._release_by = time.monotonic() + _DRIVER_JOIN_SECONDS
        self.processes.kill_until_ended(driver, max(0.0, self._release_by - time.monotonic()))
