"""Which hosts a cluster's cell runs on, from what Ray says of its nodes (``ray.nodes()``).

Pure: no Ray calls here, so every rule is tested on recorded node tables.

* A **TPU slice**: nodes Ray labelled as one slice (``ray.io/tpu-slice-name``, which
  Ray sets from the TPU VM's metadata or GKE's variables), ordered by TPU worker id (the
  placement group's bundle order is not the worker id). Each host runs the replicas
  torch_xla plans for its chips. Several alike slices are one multislice job, their hosts
  ranked slice by slice (:mod:`colab_xla.notebook.cluster.multislice`).
* **CPU hosts** (``--hosts H -n N``): H nodes with a CPU, each running N replicas on
  torch_xla's CPU backend; one bundle per node (Ray's STRICT_SPREAD) picks them.

Example::

    >>> nodes = [_tpu_node("b", "10.0.0.3", 1), _tpu_node("a", "10.0.0.2", 0)]
    >>> [found] = tpu_slices(nodes)
    >>> found.name, found.pod_type, [(h.rank, h.address) for h in found.hosts]
    ('my-v4-16', 'v4-16', [(0, '10.0.0.2'), (1, '10.0.0.3')])
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional

from ...errors import SetupError
from ..tpu_scan import from_accelerator_type

SLICE_LABEL = "ray.io/tpu-slice-name"
WORKER_LABEL = "ray.io/tpu-worker-id"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
TOPOLOGY_LABEL = "ray.io/tpu-topology"


class ClusterError(SetupError):
    """A cluster that cannot be used as asked, with what to do."""


@dataclasses.dataclass(frozen=True)
class Host:
    """Host ``rank`` of the cluster: its Ray node, address, and device."""

    rank: int
    node_id: str
    address: str
    device: str  # "TPU" or "CPU"
    chips: int = 0


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    name: str
    pod_type: str  # "v4-16"
    topology: str  # "2x2x2"
    hosts: List[Host]

    @property
    def accelerator_version(self) -> str:
        """``"v4"``, as ray.util.tpu.SlicePlacementGroup wants it."""
        return self.pod_type.split("-")[0]

    @property
    def replicas_per_host(self) -> int:
        """What torch_xla runs on each host: one replica per TPU core (two per chip on
        v2/v3, one on v4 and later)."""
        _, per_chip = from_accelerator_type(self.pod_type)
        return self.hosts[0].chips * (per_chip or 1)


def _alive(nodes: List[Mapping]) -> List[Mapping]:
    return [n for n in nodes if n.get("Alive", n.get("alive", True))]


def tpu_slices(nodes: List[Mapping], names: Optional[List[str]] = None) -> List[TpuSlice]:
    """The TPU slices among ``nodes`` (those named ``names``; every one if None), ordered
    by name, their hosts ranked slice by slice (slice k's worker w is host k * H + w).
    Several slices are one multislice job, so they must be alike."""
    slices: Dict[str, List[Mapping]] = {}
    for node in _alive(nodes):
        label = (node.get("Labels") or {}).get(SLICE_LABEL)
        if label:
            slices.setdefault(label, []).append(node)
    if not slices:
        raise ClusterError("this Ray cluster has no TPU slice (no node labelled "
                           f"{SLICE_LABEL}). For hosts without TPUs, give their count and "
                           "replicas per host: %xla_cluster connect ADDRESS --hosts H -n N.")
    missing = [n for n in names or () if n not in slices]
    if missing:
        raise ClusterError(f"no TPU slice named {', '.join(map(repr, missing))} in this Ray "
                           f"cluster; it has {', '.join(sorted(slices))}.")
    found: List[TpuSlice] = []
    for name in sorted(names or slices):
        found.append(_slice(name, slices[name], first_rank=sum(len(s.hosts) for s in found)))
    shapes = {(s.pod_type, len(s.hosts)) for s in found}
    if len(shapes) > 1:
        raise ClusterError("the TPU slices of a multislice job must be alike; these are "
                           + ", ".join(f"{s.name} ({s.pod_type}, {len(s.hosts)} hosts)"
                                       for s in found)
                           + ". Choose alike ones with --slice NAME,NAME.")
    return found


def _slice(name: str, members: List[Mapping], first_rank: int) -> TpuSlice:
    labels = members[0]["Labels"]
    ordered = sorted(members, key=lambda n: int(n["Labels"].get(WORKER_LABEL, 0)))
    workers = [int(n["Labels"].get(WORKER_LABEL, -1)) for n in ordered]
    if workers != list(range(len(ordered))):
        raise ClusterError(f"TPU slice {name!r}: Ray knows the hosts with worker ids "
                           f"{workers}, not 0 to {len(ordered) - 1}: a host is missing or "
                           "not yet up. Wait for it, or check `ray status`.")
    hosts = [Host(first_rank + worker, n["NodeID"], n["NodeManagerAddress"], "TPU",
                  int((n.get("Resources") or {}).get("TPU", 0)))
             for worker, n in enumerate(ordered)]
    return TpuSlice(name, labels.get(POD_TYPE_LABEL, "?"), labels.get(TOPOLOGY_LABEL, "?"),
                    hosts)


def cpu_hosts(nodes: List[Mapping], count: int) -> int:
    """Check that ``nodes`` have ``count`` hosts with a CPU; return how many they have."""
    usable = [n for n in _alive(nodes) if (n.get("Resources") or {}).get("CPU", 0) >= 1]
    if len(usable) < count:
        raise ClusterError(f"--hosts {count} needs {count} Ray nodes with a CPU; this "
                           f"cluster has {len(usable)}. Add nodes, or ask for fewer hosts.")
    return len(usable)


def ordered_by_bundle(bundle_nodes: Mapping[int, str], nodes: List[Mapping]) -> List[Host]:
    """CPU hosts in the order of the placement group's bundles (one node each)."""
    by_id = {n["NodeID"]: n for n in nodes}
    return [Host(rank, node_id, by_id[node_id]["NodeManagerAddress"], "CPU")
            for rank, (_, node_id) in enumerate(sorted(bundle_nodes.items()))]


def _tpu_node(node_id: str, address: str, worker: int, pod_type: str = "v4-16",
              slice_name: Optional[str] = None) -> Dict:
    """A node as ``ray.nodes()`` describes a TPU VM host (for the examples and tests)."""
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": True,
            "Resources": {"CPU": 240.0, "TPU": 4.0},
            "Labels": {SLICE_LABEL: slice_name or "my-" + pod_type, WORKER_LABEL: str(worker),
                       POD_TYPE_LABEL: pod_type, TOPOLOGY_LABEL: "2x2x2"}}
