"""A Ray cluster on this machine whose nodes look like the hosts of a TPU slice, for
test_cluster_tpu.py (``python tests/_tpu_cluster.py NOTEBOOK_PID``).

Ray makes a node a TPU host from variables it reads in the process that builds the node
(TPU_NAME, TPU_WORKER_ID, TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, as GKE sets them): it then
gives the node the slice's resources and ``ray.io/tpu-*`` labels. colab_xla's own
:class:`colab_xla.notebook.cluster.local.LocalCluster` only makes CPU hosts, hence this keeper, in
a process of its own so the test's process is only the notebook (Ray's driver).

Protocol, one JSON line per answer on stdout (Ray's processes print to stderr):

* at start: ``{"address": ..., "pids": [...]}`` once the head (no TPU) is up;
* ``tpu N SLICE`` on stdin: adds N fake TPU hosts of slice SLICE (each further slice gets
  addresses of its own, ``127.0.K.*``) in REVERSE
  worker-id order (worker N-1 first, so Ray's node and bundle order differ from the
  worker id), answers ``{"workers": {node_id: worker_id}, "pids": [...]}``;
* SIGTERM, or the notebook's process dying: kills every process of the cluster, exits.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import psutil

from colab_xla.wire import lifetime

OBJECT_STORE_BYTES = 128 * 2**20


def tpu_env(worker: int, name: str) -> dict:
    return {"TPU_NAME": name, "TPU_WORKER_ID": str(worker),
            "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_TOPOLOGY": "2x2x2"}


def host_address(worker: int, slice_number: int) -> str:
    """Host ``worker``'s own loopback address (127.0.0.0/8 is all this machine's), so the
    hosts' addresses tell them apart, as a real slice's do."""
    return f"127.0.{slice_number}.{10 + worker}"


def _descendants() -> list:
    return [p.pid for p in psutil.Process().children(recursive=True)]


def main(notebook_pid: int) -> None:
    lifetime.adopt_orphans()  # Ray's per-node agents outlive their raylet otherwise
    answer = os.dup(1)
    os.dup2(2, 1)

    def say(obj) -> None:
        os.write(answer, (json.dumps(obj) + "\n").encode())

    def end(signum, frame):
        lifetime.end_descendants()
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    lifetime.die_with_parent(notebook_pid, signal.SIGTERM)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # everything on 127.0.0.1
    from ray.cluster_utils import Cluster

    try:
        cluster = Cluster()
        cluster.add_node(num_cpus=0, include_dashboard=False,
                         object_store_memory=OBJECT_STORE_BYTES)
    except BaseException as exc:  # noqa: BLE001 - said to the test
        say({"error": f"{type(exc).__name__}: {exc}"})
        end(None, None)
    say({"address": cluster.address, "pids": _descendants()})
    slice_names: list = []
    for line in sys.stdin:
        command, count, name = line.split()
        assert command == "tpu", line
        if name not in slice_names:
            slice_names.append(name)
        workers = {}
        try:
            for worker in reversed(range(int(count))):
                env = tpu_env(worker, name)
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)  # Ray reads them here, where the node is built
                try:
                    node = cluster.add_node(num_cpus=1, resources={"TPU": 4}, env_vars=env,
                                            node_ip_address=host_address(
                                                worker, slice_names.index(name)),
                                            object_store_memory=OBJECT_STORE_BYTES,
                                            include_dashboard=False)
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                workers[node.node_id] = worker
            cluster.wait_for_nodes()
        except BaseException as exc:  # noqa: BLE001 - said to the test
            say({"error": f"{type(exc).__name__}: {exc}"})
            continue
        say({"workers": workers, "pids": _descendants()})
    end(None, None)  # stdin closed: the test is done with the cluster


if __name__ == "__main__":
    main(int(sys.argv[1]))
