"""The job of a replica: what the notebook gives every replica process of a run (or of
a session) and what a replica process does with it as soon as it arrives.

A :class:`ReplicaJob` is made in the notebook and passed to the launcher; without fork it
is pickled, and unpickling it in the replica process is the first code of colab_xla that
runs there (:func:`arrived`): the replicas' environment, and fd 1 and 2 to the run's
start-up pipe, before torch_xla starts its runtime.
"""

from __future__ import annotations

import base64
import ctypes
import os
import pickle
import select
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from . import stacks
from .cell import CellModule

# The notebook's pid, in the forkserver's environment only (colab_xla.replica.forkserver_init).
NOTEBOOK_PID = "COLAB_XLA_NOTEBOOK_PID"


@dataclass(frozen=True)
class ReplicaJob:
    """What xmp.spawn passes (pickled) to every replica process."""

    run_id: str
    run_dir: str
    channel_path: str  # the named pipe of frames (see colab_xla.wire.frames)
    parent_pid: int  # the replica process's parent: the notebook, or the forkserver
    lock: Any = None  # a Manager lock proxy (pickles, works across processes), if used
    # Named pipes (stdout, stderr), one pair per replica process (by local rank): C-level
    # output (XLA, absl, libtpu logs, printf) goes there, read by the notebook.
    fd_paths: Tuple[Tuple[str, str], ...] = ()
    # A named pipe for fd 1 and 2 of every replica process from its first moment until its
    # rank is known (what torch_xla's runtime start-up prints, and its fatal errors).
    startup_path: Optional[str] = None
    # The replicas' whole environment: the notebook's, with the run's variables.
    environ: Optional[Dict[str, str]] = None
    # Without fork (spawn, forkserver): the cell and the notebook names it uses.
    cell: Optional[CellModule] = None
    names: Optional[bytes] = None
    cache_dir: Optional[str] = None  # --cache: torch_xla's persistent compilation cache
    pull: Tuple[str, ...] = ()  # --pull: names sent back after the cell
    pull_from: Optional[int] = None  # --pull-from: only this replica sends them
    shm_dir: Optional[str] = None  # where large CPU tensors go (colab_xla.wire.shared_tensors)
    # Output through a ring per replica process in this directory (colab_xla.wire.ring), for
    # a reader that reads rings; None: every frame is a write to the pipe. A session's cells
    # name the same one, and a replica process makes its ring once.
    ring_dir: Optional[str] = None
    # The replicas that run the cell (a session's, by index: --targets); None: all.
    chosen: Optional[Tuple[int, ...]] = None

    def __reduce__(self):
        return _arrive, (dict(self.__dict__),)

    def apply_environ(self) -> None:
        """Make this process's environment the one the notebook chose for the replicas."""
        if self.environ is not None and dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)


def _arrive(fields: Dict[str, Any]) -> ReplicaJob:
    """Unpickle the job in a replica process, and set its environment there and then.

    Unpickling is the first code of colab_xla that runs in a replica process, before
    torch_xla starts the runtime (which reads PJRT_DEVICE, CPU_NUM_DEVICES, XLA_FLAGS...).
    A forkserver's children inherit the server's environment, not the notebook's, so
    waiting for ``main`` would be too late.
    """
    return arrived(ReplicaJob(**fields))


def arrived(job: ReplicaJob) -> ReplicaJob:
    """What a replica process does with its job first: the replicas' environment, and its
    start-up output captured. (A forked process that got the job without pickling calls
    it itself.)"""
    job.apply_environ()
    if job.startup_path:  # (a session's cells have none: their processes started long ago)
        capture_startup(job.startup_path)
    # Where it is, when the notebook asks (colab_xla.wire.stacks): a file beside its ring,
    # which a session's cells share (made once), and which outlives the cell's run
    # directory (a session that ends in the cell, its own directory).
    stacks.register(job.ring_dir or job.run_dir)
    return job


def capture_startup(path: str) -> None:
    """fd 1 and 2 of a replica process to the run's start-up pipe, before torch_xla starts
    its runtime there; and Python's fatal-error handler on, so a native crash (XLA's abort
    on a bad flag, a segfault) leaves the stack of every thread in the process output."""
    import faulthandler

    ctypes.CDLL(None).fflush(None)
    fd = os.open(path, os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Off first: enabling an enabled faulthandler installs nothing, and the notebook's
    # process may have enabled it before something else took the signals (Ray's driver
    # does both: its handler, inherited here, would swallow the fatal error's stacks).
    faulthandler.disable()
    faulthandler.enable(file=2, all_threads=True)


# A session's cell goes to each replica on its command pipe (see command_path) as one
# line, ``job BASE64``, its job pickled, when that fits in one atomic write of a pipe
# (PIPE_BUF, 4096 bytes on Linux: never mixed with another thread's command, and never
# waiting on a replica that reads late). A larger one (the notebook names the cell brings)
# goes as ``run PATH``, the path of a file holding it pickled. (In the line, the notebook
# writes no file and no replica opens one.)
INLINE_JOB_BYTES = (select.PIPE_BUF - len("job \n")) // 4 * 3


def job_to_command(job: ReplicaJob, directory: str) -> str:
    """The command that sends ``job`` to a session's replicas: the job in the line, or in a
    file of ``directory`` (removed with the cell's files)."""
    data = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) <= INLINE_JOB_BYTES:
        return "job " + base64.b64encode(data).decode("ascii")
    path = os.path.join(directory, "job.pickle")
    with open(path, "wb") as f:
        f.write(data)
    return f"run {path}"


JOB_VERBS = ("job", "run")  # the commands that carry a job (job_to_command)


def job_from_command(verb: str, arg: str) -> ReplicaJob:
    """The job a ``job`` or ``run`` command (:func:`job_to_command`) sends."""
    if verb == "job":
        return pickle.loads(base64.b64decode(arg))
    with open(arg, "rb") as f:  # (closed before the cell starts: it sees none open)
        return pickle.load(f)


def command_path(session_dir: str, index: int) -> str:
    """The named pipe of replica ``index``'s commands between cells (a cell, ``debug``,
    ``stop``): read by the replica's own thread as it waits for the next cell."""
    return os.path.join(session_dir, f"commands-{index}")


def urgent_path(session_dir: str, index: int) -> str:
    """The named pipe of replica ``index``'s commands that cannot wait for its cell to
    end (``interrupt``, ``complete``): read by a thread of the replica's own."""
    return os.path.join(session_dir, f"urgent-{index}")


# The commands that go to a replica's urgent pipe (urgent_path); the others to its
# command pipe (command_path).
URGENT_VERBS = ("interrupt", "complete")


def failure_path(session_dir: str, index: int) -> str:
    """The file where session replica ``index`` writes why it failed outside a cell, just
    before its process ends (its stderr may be a pipe nobody reads any more)."""
    return os.path.join(session_dir, f"failed-{index}.txt")
