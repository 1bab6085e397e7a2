"""Where a replica's host stands in a cluster of hosts (``%xla_cluster``), as the
environment variables a host's agent gives its replicas.

IPython-free and Ray-free: the replicas read it (their ``index``, ``host`` and
``local_index``; the collectives of CPU hosts), the agents write it
(:mod:`colab_xla.notebook.cluster.agent`). Without these variables a replica is on a host of its
own, as in every run that is not on a cluster.

Example::

    >>> rank = HostRank(host=1, hosts=2, replicas=4, address="10.0.0.3",
    ...                 store="10.0.0.2:29400", run="3f2a")
    >>> rank.index(2), rank.world
    (6, 8)
    >>> HostRank.from_environ(rank.environ()) == rank
    True
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional

_PREFIX = "COLAB_XLA_CLUSTER_"
# Every variable, so that a host's agent can drop stale ones.
VARIABLES = tuple(_PREFIX + n for n in ("HOST", "HOSTS", "REPLICAS", "ADDRESS", "STORE", "RUN"))
# Set, a runtime client skips MegaScale discovery: a replica process's first client must not
# inherit it (colab_xla.runtimes.runtime_clients sets it once that client exists; a
# multislice host's variables are colab_xla.notebook.cluster.multislice's).
SKIP_DISCOVERY = "SKIP_MEGASCALE_PJRT_CLIENT"


@dataclasses.dataclass(frozen=True)
class HostRank:
    """Host ``host`` of ``hosts``, each running ``replicas`` replicas; ``address`` is
    this host's (for gloo); ``store`` the ``ip:port`` of the store the replicas of CPU
    hosts meet at (host 0's agent keeps it; ``ip:port/secret``: their keys under that
    secret), ``run`` the prefix of this run or session in it (the same on every host)."""

    host: int
    hosts: int
    replicas: int
    address: str = "127.0.0.1"
    store: Optional[str] = None
    run: str = ""

    @property
    def world(self) -> int:
        """Replicas on every host."""
        return self.hosts * self.replicas

    def index(self, local_index: int) -> int:
        """The global ordinal of this host's replica ``local_index``."""
        return self.host * self.replicas + local_index

    def environ(self) -> Dict[str, str]:
        values = (self.host, self.hosts, self.replicas, self.address, self.store or "", self.run)
        return {name: str(value) for name, value in zip(VARIABLES, values)}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Optional["HostRank"]:
        """The rank the environment gives, or None (not on a cluster)."""
        if VARIABLES[0] not in environ:
            return None
        host, hosts, replicas, address, store, run = (environ.get(n, "") for n in VARIABLES)
        return cls(int(host), int(hosts), int(replicas), address, store or None, run)
