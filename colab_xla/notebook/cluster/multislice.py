"""Multislice: several TPU slices as one job, joined by the TPU runtime's slice-to-slice
network (MegaScale), as the environment each host's replicas get.

IPython-free and Ray-free. A cluster of several slices (``%xla_cluster connect`` on a Ray
cluster that has them, or ``%xla_cluster local --hosts H -n N --slices S`` simulating
them on CPU hosts) gives every host the four variables libtpu reads when its runtime
starts: where slice 0's first host coordinates, on which port, how many slices, and
this host's slice. They are always written fresh, and a single-slice cluster drops them:
stale values from an earlier job make libtpu wait for slices that are not there (Ray's
JAX trainer overwrites them for the same reason). Hosts are ranked slice by slice.

Example::

    >>> layout = Slices(count=2, hosts_per_slice=2, coordinator="10.0.0.2")
    >>> layout.slice_of(3), layout.worker_of(3)
    (1, 1)
    >>> layout.environ(3)["MEGASCALE_SLICE_ID"], layout.environ(3)["MEGASCALE_NUM_SLICES"]
    ('1', '2')

What runs inside a replica process so that discovery happens once there is
:mod:`colab_xla.runtimes.runtime_clients`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from ...errors import SetupError

COORDINATOR_ADDRESS = "MEGASCALE_COORDINATOR_ADDRESS"
PORT_VARIABLE = "MEGASCALE_PORT"
NUM_SLICES = "MEGASCALE_NUM_SLICES"
SLICE_ID = "MEGASCALE_SLICE_ID"
VARIABLES = (COORDINATOR_ADDRESS, PORT_VARIABLE, NUM_SLICES, SLICE_ID)
# MegaScale's coordinator port (ray.util.tpu's DEFAULT_MEGASCALE_PORT, MaxText's too).
PORT = 8081


@dataclasses.dataclass(frozen=True)
class Slices:
    """``count`` slices of ``hosts_per_slice`` hosts each; ``coordinator`` is the
    address of slice 0's first host (host 0 of the cluster)."""

    count: int
    hosts_per_slice: int
    coordinator: str
    port: int = PORT

    @property
    def hosts(self) -> int:
        return self.count * self.hosts_per_slice

    def slice_of(self, host: int) -> int:
        """The slice of the cluster's host ``host``."""
        return host // self.hosts_per_slice

    def worker_of(self, host: int) -> int:
        """Host ``host``'s rank within its slice (its ``TPU_WORKER_ID``)."""
        return host % self.hosts_per_slice

    def members(self, host: int, hostnames: List[str]) -> List[str]:
        """The addresses of the hosts of ``host``'s slice (its ``TPU_WORKER_HOSTNAMES``)."""
        first = self.slice_of(host) * self.hosts_per_slice
        return hostnames[first:first + self.hosts_per_slice]

    def environ(self, host: int) -> Dict[str, str]:
        """The MegaScale variables of the cluster's host ``host``."""
        return {COORDINATOR_ADDRESS: self.coordinator, PORT_VARIABLE: str(self.port),
                NUM_SLICES: str(self.count), SLICE_ID: str(self.slice_of(host))}


def check(hosts: int, slices: Optional[int]) -> None:
    """Refuse ``slices`` slices of ``hosts`` CPU hosts unless they divide the hosts."""
    if slices is not None and (slices < 1 or hosts % slices):
        raise SetupError(f"--slices {slices}: give a number of slices that divides the hosts "
                         f"({hosts}); every slice has as many hosts (e.g. --hosts 4 "
                         "--slices 2).")


def split(hosts: int, slices: Optional[int], coordinator: str) -> Optional[Slices]:
    """``hosts`` CPU hosts as ``slices`` slices of equal size (None: one slice, no
    MegaScale variables); refused as :func:`check` does."""
    check(hosts, slices)
    return None if slices in (None, 1) else Slices(slices, hosts // slices, coordinator)
