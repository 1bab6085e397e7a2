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

On a machine others share, the cluster is this user's alone: Ray's token authentication is
on (``RAY_AUTH_MODE=token``), with a token made for this cluster in a file only this user
can read, which the keeper (so the head, every node and every worker) and this process (the
driver) are given; without it another user's ``ray.init(address)`` or raylet is refused
(``AuthenticationError``), where it would otherwise run code as this user. Ray's files (its
sessions, sockets, logs, ``ray_current_cluster``) go to the same private directory
(``RAY_TMPDIR``), not to ``/tmp/ray``, which anyone can make first or enter; the directory is
removed when the cluster stops, and by the next local cluster if its notebook was killed.
Every Ray process listens on 127.0.0.1 (:func:`local_addresses`).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
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
    """A Ray head with ``hosts`` nodes of one CPU each, on this machine, in a private
    directory of its own (:attr:`directory`, with the token file :attr:`token_path`).

    While it is up, this process's environment has the cluster's token (the driver's
    ``ray.init`` needs it); :meth:`shutdown` puts back what was there."""

    def __init__(self, hosts: int):
        self.directory = private_directory(hosts)
        self.token_path = write_token(self.directory)
        self._driver = None
        environ = ray_environment(self.directory, self.token_path)
        # What Ray's processes print goes to a log file: a pipe nobody reads would fill
        # and block them.
        self.log_path = os.path.join(state.new_log_dir(), "local-cluster.log")
        # A session of its own: Jupyter's Interrupt is a SIGINT to the kernel's whole process
        # group, and it ended the keeper and Ray's processes with every interrupted cell
        # (the connection ended with them). It still dies with the notebook's process.
        with open(self.log_path, "ab") as log:
            self._keeper = subprocess.Popen(
                [sys.executable, "-m", "colab_xla.notebook.cluster.local", str(hosts),
                 str(os.getpid()), self.directory],
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
        self._driver = driver_token(self.token_path)

    def shutdown(self) -> None:
        """Stop every process of the cluster (the keeper kills them, then ends), remove its
        directory, and put back this process's own token settings."""
        if self._keeper.poll() is None:
            self._keeper.send_signal(signal.SIGTERM)
            try:
                self._keeper.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self._keeper.kill()
                self._keeper.wait()
        self._keeper.stdout.close()
        self.record.close()
        _remove(self.directory)
        if self._driver is not None:
            _set_token_settings(self._driver)
            self._driver = None


# Ray's token settings, in the environment of every process of a cluster and of its driver.
AUTH_MODE, TOKEN_PATH, TOKEN = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"
_TOKEN_SETTINGS = (AUTH_MODE, TOKEN_PATH, TOKEN)


def ray_environment(directory: str, token_path: str) -> dict:
    """The keeper's environment, which Ray's processes inherit: this machine's addresses
    (:func:`local_addresses`), token authentication with the cluster's token (a token the
    notebook's environment names for other clusters left out), Ray's files in
    ``directory``, and the folder ``lean_imports`` first on their path: the stand-ins
    there, and why, are in its files."""
    lean = os.path.join(os.path.dirname(__file__), "lean_imports")
    path = [lean] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    environ = {k: v for k, v in os.environ.items() if k not in _TOKEN_SETTINGS}
    return {**environ, _LOOPBACK: "0", "PYTHONPATH": os.pathsep.join(path),
            AUTH_MODE: "token", TOKEN_PATH: token_path, "RAY_TMPDIR": directory}


# The longest Unix socket Ray makes in its temporary directory (a node's object store), after
# the directory: "/ray/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store.<n>".
_RAY_SOCKET_TAIL = len("/ray/session_2026-12-01_20-00-00_000000_/sockets/plasma_store.")
DIRECTORY_PREFIX = "ray-"
FALLBACK_PREFIX = "colab_xla-ray-"  # in /tmp, where the state directory is too long a path


def private_directory(hosts: int) -> str:
    """A new directory, mode 0700 and of a random name, for one local cluster's files: in
    colab_xla's state directory (:mod:`colab_xla.notebook.state`), or in /tmp where that
    path would make Ray's sockets longer than a Unix socket's path may be. It names the
    notebook process it belongs to (a file ``notebook``); those of notebook processes that
    are gone are removed first (:func:`sweep`)."""
    sweep()
    parent = state.state_dir()
    longest = (len(os.path.join(parent, DIRECTORY_PREFIX + "x" * 8).encode())
               + _RAY_SOCKET_TAIL + len(str(_pid_max())) + len(str(hosts)))
    if longest > state.MAX_SOCKET_PATH:
        directory = tempfile.mkdtemp(prefix=FALLBACK_PREFIX, dir="/tmp")
    else:
        directory = tempfile.mkdtemp(prefix=DIRECTORY_PREFIX, dir=parent)
    with open(os.path.join(directory, "notebook"), "x") as marker:
        marker.write(state.kernel_key())
    return directory


def sweep() -> None:
    """Remove the directories of local clusters whose notebook process is gone (killed with
    its keeper before they could remove their own): this user's, in the state directory
    and /tmp."""
    for parent, prefix in ((state.state_dir(), DIRECTORY_PREFIX), ("/tmp", FALLBACK_PREFIX)):
        try:
            names = [n for n in os.listdir(parent) if n.startswith(prefix)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(parent, name)
            key = _owner(path)
            if key is not None and not state.kernel_alive(key):
                shutil.rmtree(path, ignore_errors=True)


def _owner(path: str):
    """The notebook process (its key) a local cluster's directory ``path`` names, if it is
    this user's own directory (not a link); else None."""
    if not state.private(path):
        return None
    try:
        fd = os.open(os.path.join(path, "notebook"), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as marker:
            return marker.read().strip()
    except OSError:
        return None


def _remove(directory: str, seconds: float = 10.0) -> None:
    """Remove ``directory``, again while a Ray process that was killed but has not yet
    ended still writes in it (a loaded machine), for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        shutil.rmtree(directory, ignore_errors=True)
        if not os.path.lexists(directory) or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 4194304  # Linux's largest


def write_token(directory: str) -> str:
    """A new random token for one cluster, in a file of ``directory`` only this user can
    read (made so: mode 0600, never through a link or over a file already there)."""
    path = os.path.join(directory, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, as Ray's own tokens
    return path


def driver_token(token_path: str) -> dict:
    """Give this process (Ray's driver) the cluster's token: what its environment had
    before is returned, for :func:`_set_token_settings` to put back."""
    before = {k: os.environ.get(k) for k in _TOKEN_SETTINGS}
    _set_token_settings({AUTH_MODE: "token", TOKEN_PATH: token_path, TOKEN: None})
    return before


def _set_token_settings(settings: dict) -> None:
    """Set (a value) or unset (None) Ray's token settings in this process's environment,
    and have Ray read them again: it read them once, when imported (its own
    ``ray.init`` does the same when it turns authentication on)."""
    for key, value in settings.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if "ray._raylet" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


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


def _keep(hosts: int, notebook_pid: int, directory: str) -> None:
    """The keeper: start the nodes, say the address, and kill them all (then remove the
    cluster's ``directory``) when told to stop (SIGTERM) or when the notebook's process
    dies."""
    lifetime.adopt_orphans()  # Ray's node agents, orphaned when their raylet goes
    answer = os.dup(1)  # the notebook reads one line; Ray's processes print to the log
    os.dup2(2, 1)

    def end(signum, frame):
        lifetime.end_descendants()
        _remove(directory)
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
    signal.signal(signal.SIGTERM, end)  # again: Ray's nodes put a handler of their own
    os.write(answer, (json.dumps({"address": cluster.address}) + "\n").encode())
    os.close(answer)
    while True:
        signal.pause()


if __name__ == "__main__":
    _keep(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
