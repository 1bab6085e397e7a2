"""A session's replicas as one cell's :class:`~colab_xla.notebook.supervisor.Supervisor`
runs on them (:class:`SessionReplicas`, a :class:`~colab_xla.notebook.replicas.Replicas`):
the cell is sent to replicas the session keeps, and a cut run interrupts them instead of
killing them, unless they do not come back within :data:`INTERRUPT_GRACE_SECONDS`.
"""

from __future__ import annotations

import threading
import time
from typing import List, Optional

from ...wire.job import ReplicaJob
from ..outcome import format_ordinals
from ..pipes import RunPipes
from ..replicas import Replicas

# After an Interrupt (or --timeout, or fail-fast), how long every replica has to finish its
# cell before the session is ended.
INTERRUPT_GRACE_SECONDS = 2.0
# How long the processes of an ending session may take to go (killed until then).
KILL_SECONDS = 5.0
# How long every replica has to take a cell sent to it (they wait for it, warm: a replica
# that does not is stuck between cells, and the cell would wait for it forever).
TAKE_SECONDS = 60.0


class SessionReplicas(Replicas):
    """A session's replicas, as one cell's :class:`colab_xla.notebook.supervisor.Supervisor` sees
    them: the cell is sent to them, and a cut run interrupts them instead of killing
    them, unless they do not come back in time. ``session``: a
    :class:`colab_xla.notebook.targets.session.Session`."""

    start_seconds = TAKE_SECONDS
    running = True
    answer_first = True  # (the interrupt's command thread does: Interruptible.interrupt)

    def __init__(self, session):
        self.session, self.run_id = session, None
        self.grace = INTERRUPT_GRACE_SECONDS
        # Set when every replica has ended the cell (or the session has ended). The driver
        # thread is alive a moment longer (it tells the supervisor first): its is_alive()
        # would count a cell that ended in time as one still running.
        self._returned = threading.Event()

    def pipes(self, directory: str, processes: int) -> RunPipes:
        return self.session.pipes.lend()  # (kept from cell to cell)

    def done_with(self, pipes: RunPipes) -> None:
        self.session.pipes.give_back()

    threaded = False  # (it sends the cell to replicas that wait for it)

    def drive(self, job: ReplicaJob, ended, over) -> None:
        self.run_id = job.run_id

        def cell_over() -> None:
            self._returned.set()
            over()

        try:
            self.session.dispatch(job, ended, cell_over)
        except BaseException:
            self._returned.set()
            raise

    def started(self, pid: int) -> None:
        self.session.processes.track(pid)

    def finished(self, ordinal: int) -> None:
        self.session.finished(self.run_id, ordinal)

    def tick(self) -> None:
        self.session.processes.track_descendants()

    def exit_codes(self) -> List[int]:
        return self.session.deaths.exit_codes(self.session.processes)

    def memory_note(self, pid: Optional[int]) -> Optional[str]:
        return self.session.processes.memory_note(pid)

    def stop(self, driver: threading.Thread, read_until, why: str) -> None:
        if self.session.ended is None and self.session.deaths.reason is None:
            self.session.interrupt(self.run_id)
            read_until(time.monotonic() + self.grace)
        self._end_if_running(driver, untaken=why == "unstarted")

    def release(self, driver: threading.Thread) -> None:
        if (not self._returned.is_set() and self.session.ended is None
                and self.session.deaths.reason is None):
            self.session.interrupt(self.run_id)  # (a view failed while the cell ran)
            self._returned.wait(self.grace)
        self._end_if_running(driver)

    def _end_if_running(self, driver: threading.Thread, untaken: bool = False) -> None:
        """End the session if the cell still runs (a replica did not stop, or with
        ``untaken``, did not even take the cell) or a replica died: the replicas are no
        longer one group that can run the next cell."""
        if not self._returned.is_set():
            running = self.session.still_running()
            which = (f"replica{'s' if len(running) > 1 else ''} {format_ordinals(running)}"
                     if running else "a replica")
            self.session.end(self.session.deaths.reason or (
                f"{which} did not take the cell within {self.start_seconds:g} s (stuck "
                "between cells)" if untaken else
                f"{which} did not stop within {self.grace:g} s of the interrupt (native "
                "code, or a collective waiting for a peer)"))
        elif self.session.deaths.reason is not None and self.session.ended is None:
            self.session.end(self.session.deaths.reason)
        driver.join(KILL_SECONDS)
