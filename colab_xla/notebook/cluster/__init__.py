"""Every host of a cluster (a TPU pod slice, or CPU machines) from one notebook:
``%xla_cluster`` and the ``%%xla_spawn`` cells that run on it.

Ray is the engine that reaches the hosts (``pip install colab_xla[ray]``):

* :mod:`.hosts`: which hosts (a TPU slice ordered by worker id, or CPU hosts), pure;
* :mod:`.connection`: :class:`Cluster`: Ray joined, the hosts reserved, one agent each;
* :mod:`.agent`: the agent on a host, running each cell with the single-host machinery;
* :mod:`.local`: hosts on this machine, for workshops and tests.

A cell on every host is a target (:mod:`colab_xla.notebook.targets.cluster_one_off`), as is
the cluster's session, warm replicas on every host
(:mod:`colab_xla.notebook.targets.cluster_session`); both run a cell through
:mod:`colab_xla.notebook.targets.cluster_run` (one outcome with global ordinals).

This module keeps the notebook's one cluster connection.
"""

from __future__ import annotations

from typing import Optional

from .connection import Cluster
from .hosts import ClusterError

__all__ = ["Cluster", "ClusterError", "current", "connect", "start_local", "stop"]

_current: Optional[Cluster] = None


def current() -> Optional[Cluster]:
    """The notebook's cluster connection, while it is up."""
    return _current if _current is not None and _current.up else None


def connect(address: Optional[str] = "auto", *, hosts: Optional[int] = None,
            replicas: Optional[int] = None, slice_name: Optional[str] = None,
            slices: Optional[int] = None, announce=print) -> Cluster:
    """Connect this notebook to the Ray cluster at ``address`` (see :meth:`Cluster.connect`)."""
    global _current
    _check_none()
    _current = Cluster.connect(address, hosts=hosts, replicas=replicas,
                               slice_name=slice_name, slices=slices, announce=announce)
    return _current


def start_local(hosts: int, replicas: int, slices: Optional[int] = None,
                announce=print) -> Cluster:
    """Start a cluster of ``hosts`` CPU hosts on this machine and connect to it; with
    ``slices``, its hosts simulate that many slices (each host gets its MegaScale
    variables, :mod:`colab_xla.notebook.cluster.multislice`)."""
    global _current
    _check_none()
    from . import multislice
    from .connection import import_ray
    from .local import LocalCluster, local_addresses

    multislice.check(hosts, slices)  # refused before anything starts
    local_addresses()
    import_ray()  # said before anything starts

    if announce:
        announce(f"colab_xla: starting a local Ray cluster of {hosts} hosts on this machine")
    local = LocalCluster(hosts)
    try:
        _current = Cluster.connect(local.address, hosts=hosts, replicas=replicas,
                                   slices=slices, local=local, announce=announce)
    except BaseException:
        local.shutdown()
        raise
    return _current


def stop() -> Optional[Cluster]:
    """End the notebook's cluster connection (and its local cluster), if any."""
    global _current
    cluster, _current = _current, None
    if cluster is not None:
        cluster.stop()
    return cluster


def _check_none() -> None:
    if current() is not None:
        raise ClusterError("this notebook is already connected to a cluster: "
                           "%xla_cluster stop first.")
