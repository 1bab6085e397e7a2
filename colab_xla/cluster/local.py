"""A cluster of hosts on this machine (``%xla_cluster local --hosts H -n N``): a Ray
head and H Ray nodes, all on 127.0.0.1, for workshops without a pod and for the tests.

Each node is a host of CPU replicas, as on a real cluster of CPU machines; what a cell
does across hosts (collectives through gloo between the hosts' replicas) simulates the
program, not a TPU pod's interconnect. The nodes are processes of this notebook's; they
are recorded like a run's (:mod:`colab_xla.processes`), so if the notebook dies first
``%xla_doctor`` finds those still alive.
"""

from __future__ import annotations

import os

import psutil

from .. import processes
from .connection import import_ray

# Each node's object store: small, the cells' values travel as Ray call results.
OBJECT_STORE_BYTES = 128 * 2**20


class LocalCluster:
    """A Ray head with ``hosts`` nodes of one CPU each, on this machine."""

    def __init__(self, hosts: int):
        # Keep every node on 127.0.0.1 (ray start would bind the machine's address).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import_ray()
        from ray.cluster_utils import Cluster

        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        self.record = processes.RunRecord("cluster")
        self._cluster = Cluster()
        try:
            self._cluster.add_node(num_cpus=0, include_dashboard=False,
                                   object_store_memory=OBJECT_STORE_BYTES)
            for _ in range(hosts):
                self._cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
        except BaseException:
            self._cluster.shutdown()
            raise
        finally:
            for proc in me.children(recursive=True):
                if proc.pid not in before:
                    self.record.add(proc)
        self.address = self._cluster.address

    def shutdown(self) -> None:
        self._cluster.shutdown()
        self.record.close()
