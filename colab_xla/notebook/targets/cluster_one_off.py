"""The target :class:`ClusterOneOff`: a cell on every host of a cluster, on replicas each
host's agent starts for it (a one-off run per host), and :func:`run_on_cluster`, a cell from
keywords on the cluster's session or on every host (scripts, tests, benchmarks). The run
itself is :func:`colab_xla.notebook.targets.cluster_run.run_on_hosts`, which a cluster's
session runs its cells through too.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

from ... import runtimes
from ...wire.cell import Cell
from ..chosen import parse as chosen_replicas
from ..cluster.connection import Cluster
from ..outcome import RunObserver, RunOutcome
from ..request import DEFAULT_STALL_SECONDS, CellRequest, LaunchAsked
from .cluster_run import HOSTS_OWN, run_on_hosts
from .target import Target


class ClusterOneOff(Target):
    """Every host of a connected cluster, each running the cell on replicas its agent starts
    for it (a one-off run per host): ``index`` is the global ordinal, ``host`` the host's
    rank, ``local_index`` the ordinal on the host. ``--runtime jax`` (and
    ``--devices-per-process``) make them JAX processes of one job."""

    own_options = (HOSTS_OWN,)

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def run(self, request: CellRequest,
            observer: Optional[RunObserver] = None) -> RunOutcome:
        self.cluster.check_up()
        self.refuse(request)
        return run_on_hosts(self.cluster, request, observer)

    def describe(self) -> str:
        return self.cluster.describe()

    def stop(self) -> None:
        self.cluster.stop()



def run_on_cluster(cluster: Cluster, source: str, *, user_ns: Optional[Mapping] = None,
                   label: str = "cell", header: str = "# %%xla_spawn",
                   observer: Optional[RunObserver] = None, announce=print,
                   timeout: Optional[float] = None, pull: Sequence[str] = (),
                   pull_from: Optional[int] = None,
                   runtime: Union[runtimes.Runtime, str, None] = None,
                   devices_per_process: Optional[int] = None,
                   stall: Optional[float] = DEFAULT_STALL_SECONDS,
                   targets: Optional[str] = None) -> RunOutcome:
    """Run ``source`` on every replica of every host of ``cluster`` (the warm ones of its
    session, if one is up); the outcome has every replica by global ordinal,
    ``outcome.hosts`` their host.

    ``runtime`` is a runtime or its name, ``--runtime``'s (with the JAX runtime,
    ``devices_per_process`` devices per process on CPU hosts); None: the session's, if
    one is up, else the default. A session's cells run in its runtime: asking another is
    refused. ``stall``: as for :func:`colab_xla.notebook.targets.run_cell`, each host's
    quiet replicas said. ``targets`` (``"0,3"``, ``"1:0-1"``: ``--targets``, by global
    ordinal or HOST:R) runs it on those of the session's replicas only."""
    request = CellRequest(Cell(source, label=label, header=header),
                          user_ns=user_ns if user_ns is not None else {},
                          launch=LaunchAsked(runtime=runtime,
                                             devices_per_process=devices_per_process),
                          timeout=timeout, pull=tuple(pull), pull_from=pull_from,
                          announce=announce, stall=stall,
                          targets=None if targets is None else chosen_replicas(targets))
    warm = cluster.session
    target = warm if warm is not None and warm.up else ClusterOneOff(cluster)
    return target.run(request, observer)
