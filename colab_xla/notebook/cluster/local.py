"""A cluster of hosts on this machine (``%xla_cluster local --hosts H -n N``): a Ray
head and H Ray nodes, all on 127.0.0.1, for workshops without a pod and for the tests.

Each node is a host of CPU replicas, as on a real cluster of CPU machines; what a cell
does across hosts (collectives through gloo between the hosts' replicas) simulates the
program, not a TPU pod's interconnect.

The nodes are started by a keeper process of their own (``python -m
colab_xla.notebook.cluster.local``), which dies with the notebook's process and then kills every
process of the cluster (Ray's per-node agents outlive their node otherwise). The keeper
is recorded like a run's processes (:mod:`colab_xla.notebook.processes`), for ``%xla_doctor``.
Ray's processes inherit its environment (:func:`ray_environment`), which spares each of them
an import Ray does not need (``lean_imports/``): on a loaded machine a raylet aborted
while its agent was still importing it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import psutil

from .. import processes, state
from ...wire import lifetime
from .hosts import ClusterError

# Each node's object store: small, the cells' values travel as Ray call results.
OBJECT_STORE_BYTES = 128 * 2**20
START_SECONDS = 180.0
STOP_SECONDS = 30.0


def local_addresses() -> None:
    """Make Ray keep this machine's nodes, and this driver, on 127.0.0.1 (it resolves
    127.0.0.1 to the machine's address otherwise, where a local cluster is not)."""
    os.environ[_LOOPBACK] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # Ray read the variable when imported: tell it again
        constants.ENABLE_RAY_CLUSTER = False


_LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class LocalCluster:
    """A Ray head with ``hosts`` nodes of one CPU each, on this machine."""

    def __init__(self, hosts: int):
        environ = ray_environment()
        # What Ray's processes print goes to a log file: a pipe nobody reads would fill
        # and block them.
        self.log_path = os.path.join(state.new_log_dir(), "local-cluster.log")
        # A session of its own: Jupyter's Interrupt is a SIGINT to the kernel's whole process
        # group, and it ended the keeper and Ray's processes with every interrupted cell
        # (the connection ended with them). It still dies with the notebook's process.
        with open(self.log_path, "ab") as log:
            self._keeper = subprocess.Popen(
                [sys.executable, "-m", "colab_xla.notebook.cluster.local", str(hosts),
                 str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=environ,
                start_new_session=True)
        self.record = processes.RunRecord(f"cluster-{self._keeper.pid}")
        self.record.add(psutil.Process(self._keeper.pid))
        line = _read_line(self._keeper, START_SECONDS)
        if not line.startswith("{"):
            self.shutdown()
            raise ClusterError(f"the local Ray cluster did not start: {line} "
                               f"(see {self.log_path})")
        self.address = json.loads(line)["address"]
        for proc in psutil.Process(self._keeper.pid).children(recursive=True):
            self.record.add(proc)

    def shutdown(self) -> None:
        """Stop every process of the cluster (the keeper kills them, then ends)."""
        if self._keeper.poll() is None:
            self._keeper.send_signal(signal.SIGTERM)
            try:
                self._keeper.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self._keeper.kill()
                self._keeper.wait()
        self._keeper.stdout.close()
        self.record.close()


def ray_environment() -> dict:
    """The keeper's environment, which Ray's processes inherit: this machine's addresses
    (:func:`local_addresses`), and the folder ``lean_imports`` first on their path: the
    stand-ins there, and why, are in its files."""
    lean = os.path.join(os.path.dirname(__file__), "lean_imports")
    path = [lean] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, _LOOPBACK: "0", "PYTHONPATH": os.pathsep.join(path)}


def _read_line(proc: subprocess.Popen, seconds: float) -> str:
    """The keeper's first line: the cluster's address, or why it failed (the whole
    story is in the log)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline().decode(errors="replace").strip()
            if line:
                return line
        if proc.poll() is not None:
            return f"the keeper exited with code {proc.returncode}"
    return f"no answer within {seconds:g} s"


def _keep(hosts: int, notebook_pid: int) -> None:
    """The keeper: start the nodes, say the address, and kill them all when told to stop
    (SIGTERM) or when the notebook's process dies."""
    lifetime.adopt_orphans()  # Ray's node agents, orphaned when their raylet goes
    answer = os.dup(1)  # the notebook reads one line; Ray's processes print to the log
    os.dup2(2, 1)

    def end(signum, frame):
        lifetime.end_descendants()
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    lifetime.die_with_parent(notebook_pid, signal.SIGTERM)  # (nothing to end before this)
    from ray.cluster_utils import Cluster

    try:
        cluster = Cluster()
        cluster.add_node(num_cpus=0, include_dashboard=False,
                         object_store_memory=OBJECT_STORE_BYTES)
        for _ in range(hosts):
            cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
    except BaseException as exc:  # noqa: BLE001 - said to the notebook
        os.write(answer, f"{type(exc).__name__}: {exc}\n".encode())
        end(None, None)
    os.write(answer, (json.dumps({"address": cluster.address}) + "\n").encode())
    os.close(answer)
    while True:
        signal.pause()


if __name__ == "__main__":
    _keep(int(sys.argv[1]), int(sys.argv[2]))
