"""The notebook's connection to a cluster of hosts (``%xla_cluster``): Ray joined, the
hosts reserved once (one placement-group bundle per host), one agent per host started
and kept until :meth:`Cluster.stop`.

Ray is imported here and only here on the notebook's side (an optional extra:
``pip install colab_xla[ray]``).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from . import multislice
from ...wire.host_rank import HostRank
from .hosts import ClusterError, Host, TpuSlice, cpu_hosts, ordered_by_bundle, tpu_slices

# How long reserving the hosts and starting their agents (each imports torch_xla) may take.
RESERVE_SECONDS = 120.0
AGENT_START_SECONDS = 300.0
# Each agent serves a cell's start, polls and an interrupt at once.
AGENT_CONCURRENCY = 8


def import_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError("%xla_cluster needs Ray: pip install 'colab_xla[ray]' (or "
                           "pip install ray) in this environment and on every host.") from None
    return ray


class Cluster:
    """Hosts with one agent each. Make one with :meth:`connect` (or
    :func:`colab_xla.notebook.cluster.start_local` for hosts on this machine)."""

    def __init__(self, address: str, hosts: List[Host], agents: list, placements: list,
                 described: List[Dict], slice_name: Optional[str], local=None,
                 slices: Optional[multislice.Slices] = None):
        self.address, self.hosts, self.agents = address, hosts, agents
        self.placements, self.described = placements, described  # one per slice, or 1
        self.slice_name, self.local = slice_name, local
        self.slices = slices  # several slices as one job (MegaScale), or None
        self.cells_run = 0
        self.ended: Optional[str] = None
        self.session = None  # warm replicas on every host (targets.cluster_session), if up

    # -- start ----------------------------------------------------------------------------

    @classmethod
    def connect(cls, address: Optional[str] = "auto", *, hosts: Optional[int] = None,
                replicas: Optional[int] = None, slice_name: Optional[str] = None,
                slices: Optional[int] = None, start_method: str = "forkserver", local=None,
                announce=print) -> "Cluster":
        """Join the Ray cluster at ``address`` and start an agent on each host: those of
        its TPU slices (``slice_name``: the one, or comma-separated ones, to use; every
        slice if None; several are one multislice job), or (``hosts``) that many CPU
        hosts of ``replicas`` replicas each, as ``slices`` slices if given."""
        if (hosts is None) != (replicas is None):
            raise ClusterError("CPU hosts need both --hosts H and -n N (replicas per host); "
                               "a TPU slice needs neither.")
        if hosts is None and slices is not None:
            raise ClusterError("--slices is for CPU hosts (--hosts H -n N); the TPU slices of "
                               "a cluster are found (choose some with --slice NAME,NAME).")
        if hosts is not None:
            multislice.check(hosts, slices)  # refused before Ray starts
        ray = import_ray()
        joined = not ray.is_initialized()  # (else the user's own connection: left as it is)
        if joined:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        placements: list = []
        try:
            nodes = ray.nodes()
            if hosts is None:
                found = tpu_slices(nodes, slice_name.split(",") if slice_name else None)
                for each in found:
                    placements.append(_reserve_slice(ray, each))
                members = [host for each in found for host in each.hosts]
                slice_name = ",".join(each.name for each in found)
                replicas = found[0].replicas_per_host
                layout = (multislice.Slices(len(found), len(found[0].hosts), members[0].address)
                          if len(found) > 1 else None)
            else:
                cpu_hosts(nodes, hosts)
                placements.append(_reserve_cpu_hosts(ray, hosts))
                members = ordered_by_bundle(_bundle_nodes(ray, placements[0]), nodes)
                layout = multislice.split(hosts, slices, members[0].address)
            if announce:
                announce(f"colab_xla: starting an agent on each of {len(members)} hosts "
                         "(each imports torch_xla once; a few seconds)")
            agents = _start_agents(ray, placements, members, replicas, start_method, layout)
            described = _describe(ray, agents)
            if announce and local is None and not token_auth_on(ray, agents):
                announce(AUTH_OFF_WARNING.format(address=address or "auto"))
        except BaseException:
            for placement in placements:
                _release(ray, placement)
            if local is None and joined:  # a cluster this notebook joined: leave it
                ray.shutdown()
            raise
        return cls(address or "auto", members, agents, placements, described, slice_name, local,
                   layout)

    # -- use ------------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.ended is None

    @property
    def replicas(self) -> int:
        return sum(d["replicas"] or 0 for d in self.described)

    def check_up(self) -> None:
        if self.ended is not None:
            raise ClusterError(f"the cluster connection ended ({self.ended}). Connect again: "
                               "%xla_cluster connect (or local).")

    def stop(self, reason: str = "stopped") -> None:
        """End the agents (their replicas die with them), release the hosts, leave Ray,
        and stop the local cluster if this notebook started it."""
        if self.ended is not None:
            return
        if self.session is not None and self.session.up:  # each agent kills its own, by pid
            self.session.stop(f"the cluster connection ended: {reason}")
        self.ended = reason
        ray = import_ray()
        for agent in self.agents:
            try:
                ray.kill(agent)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        for placement in self.placements:
            _release(ray, placement)
        ray.shutdown()
        if self.local is not None:
            self.local.shutdown()

    def describe(self) -> str:
        lines = [f"colab_xla cluster: {'up' if self.up else 'ended (' + self.ended + ')'} · "
                 f"{len(self.hosts)} hosts · {self.replicas} replicas · "
                 f"{self.slice_name or 'CPU hosts'}"
                 + (f" · {self.slices.count} slices (multislice)" if self.slices else "")
                 + f" · {self.address}"
                 + (" (local, started by this notebook)" if self.local else "")
                 + f" · cells run: {self.cells_run}"
                 + (" · a session is up (%xla_session)" if self.session is not None
                    and self.session.up else "")]
        for d in self.described:
            lines.append(f"  host {d['host']}: {d['address']} ({d['hostname']}) · "
                         f"{d['replicas'] or '?'} {d['device']} replicas · agent pid "
                         f"{d['pid']} · torch_xla {d['torch_xla']}")
        return "\n".join(lines)


AUTH_OFF_WARNING = (
    "colab_xla: warning: this Ray cluster ({address}) has token authentication off: anyone "
    "who can reach it can run code on its hosts as their owner (docs/clusters.md#security)")


def token_auth_on(ray, agents) -> bool:
    """Whether the cluster refuses Ray calls without its token: this notebook joined with
    a token (Ray's ``RAY_AUTH_MODE=token``; a cluster with authentication on refuses a
    driver without one), and every host's node runs with token authentication on (asked
    of its agent; a node inherits it from ``ray start``'s environment)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        return False
    if not is_token_auth_enabled():
        return False
    try:
        return all(ray.get([a.__ray_call__.remote(_host_token_auth) for a in agents],
                           timeout=AGENT_START_SECONDS))
    except Exception:  # noqa: BLE001 - not told: said as off
        return False


def _host_token_auth(agent) -> bool:
    """In a host's agent (through Ray's ``__ray_call__``): whether its node has token
    authentication on."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()


def _reserve_slice(ray, found: TpuSlice):
    from ray.util.tpu import SlicePlacementGroup

    group = SlicePlacementGroup(found.topology, found.accelerator_version)
    _wait_ready(ray, group.placement_group, f"TPU slice {found.name}")
    return group


def _reserve_cpu_hosts(ray, count: int):
    from ray.util.placement_group import placement_group

    group = placement_group([{"CPU": 1}] * count, strategy="STRICT_SPREAD")
    _wait_ready(ray, group, f"{count} CPU hosts")
    return group


def _wait_ready(ray, group, what: str) -> None:
    try:
        ray.get(group.ready(), timeout=RESERVE_SECONDS)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise ClusterError(f"could not reserve {what} within {RESERVE_SECONDS:g} s: another "
                           "job holds them, or the cluster lacks them (see `ray status`)."
                           ) from None


def _pg(placement):
    return getattr(placement, "placement_group", placement)  # a SlicePlacementGroup's own


def _bundle_nodes(ray, placement) -> Dict[int, str]:
    from ray.util import placement_group_table

    table = placement_group_table(_pg(placement))
    return {int(k): v for k, v in table["bundles_to_node_id"].items()}


def _release(ray, placement) -> None:
    try:
        if hasattr(placement, "shutdown"):
            placement.shutdown()
        else:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(placement)
    except Exception:  # noqa: BLE001 - Ray already gone
        pass


def _start_agents(ray, placements: list, members: List[Host], replicas: int,
                  start_method: str, slices: Optional[multislice.Slices]) -> list:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # (here, not at the top: the agent runs cells on the targets, which import this module)
    from .agent import HostAgent

    actor = ray.remote(HostAgent)
    by_node = {node: (placement, bundle) for placement in placements
               for bundle, node in _bundle_nodes(ray, placement).items()}
    hostnames = [h.address for h in members]
    agents = []
    for host in members:
        rank = HostRank(host.rank, len(members), replicas, host.address)
        resources = {"num_cpus": 1} if host.device == "CPU" else {
            "num_cpus": 0, "resources": {"TPU": host.chips}}
        placement, bundle = by_node[host.node_id]
        strategy = PlacementGroupSchedulingStrategy(
            _pg(placement), placement_group_bundle_index=bundle)
        agents.append(actor.options(
            max_concurrency=AGENT_CONCURRENCY, scheduling_strategy=strategy,
            **resources).remote(rank, host.device, hostnames, start_method, slices))
    return agents


def _describe(ray, agents) -> List[Dict]:
    try:
        described = ray.get([a.describe.remote() for a in agents], timeout=AGENT_START_SECONDS)
    except ray.exceptions.GetTimeoutError:
        for agent in agents:
            ray.kill(agent)
        raise ClusterError(f"the host agents did not start within {AGENT_START_SECONDS:g} s "
                           "(each imports torch_xla: is it installed on every host?)") from None
    except ray.exceptions.RayActorError as exc:
        for agent in agents:
            ray.kill(agent)
        raise ClusterError(f"a host agent failed to start: {exception_line(exc, last=True)}. "
                           "colab_xla, torch and torch_xla must be installed on every host."
                           ) from None
    store = described[0]["store"]
    if store:  # CPU hosts: every host's replicas meet at host 0's store
        try:
            ray.get([a.set_store.remote(store) for a in agents], timeout=AGENT_START_SECONDS)
        except ray.exceptions.GetTimeoutError:
            for agent in agents:
                ray.kill(agent)
            raise ClusterError(f"the host agents did not take host 0's store within "
                               f"{AGENT_START_SECONDS:g} s") from None
    return described


def host_note(note: str, host: int) -> str:
    """A note a host's agent made (``colab_xla: ...``), as the notebook says it: with its host."""
    return note.replace("colab_xla: ", f"colab_xla: host {host}: ", 1)


def exception_line(exc: BaseException, last: bool = False) -> str:
    """One line of what Ray raised (its messages span many): the first line with the
    type, or (``last``) the last line, where a failed creation task names its cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if last:
        return lines[-1] if lines else type(exc).__name__
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
