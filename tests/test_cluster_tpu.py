"""``%xla_cluster connect`` to a TPU slice (no --hosts), against a real Ray cluster on
this machine whose nodes Ray takes for the hosts of a v4-16 slice (tests/_tpu_cluster.py:
Ray's TPU variables on each node, each host on a loopback address of its own).

Discovery, reservation, ordering and each agent's environment; no cell runs (there is no
TPU here for the replicas). The cluster lives in a keeper process the test starts and
ends by pid: this process is only the notebook (Ray's driver).

The hosts are added worker 1 first, so Ray's node order and the slice placement group's
bundle order differ from the TPU worker id that ranks the hosts. The last test makes two
such slices, one multislice job (each host's MegaScale variables), on a keeper of its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import time

import psutil
import pytest

from colab_xla.notebook.cluster import multislice
from colab_xla.notebook.cluster.hosts import SLICE_LABEL, WORKER_LABEL, ClusterError
from _kernel import wait_until_gone  # tests/ is on sys.path

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray (colab_xla[ray]) is not installed in this stack")
pytestmark = [needs_ray, pytest.mark.cluster]

HERE = os.path.dirname(os.path.abspath(__file__))
SLICE, HOSTS = "fake-v4-16", 2
PER_CHIP = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS")
ANSWER_SECONDS = 120.0


class Keeper:
    """The keeper process of the fake slice's Ray cluster (tests/_tpu_cluster.py)."""

    def __init__(self, log_path: str, **environ):
        env = {**os.environ, **environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "PYTHONPATH": os.pathsep.join(
                   [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "_tpu_cluster.py"), str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        self.pids = set()
        self.workers = None  # node id -> TPU worker id, once the hosts are added
        self.address = self._answer()["address"]

    def add_tpu_hosts(self, count: int) -> dict:
        if self.workers is None:
            self.workers = self.add_slice(count, SLICE)
        return self.workers

    def add_slice(self, count: int, name: str) -> dict:
        """Add ``count`` fake hosts of slice ``name``; their node ids -> worker ids."""
        self.proc.stdin.write(f"tpu {count} {name}\n".encode())
        self.proc.stdin.flush()
        return self._answer()["workers"]

    def _answer(self) -> dict:
        deadline = time.monotonic() + ANSWER_SECONDS
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                line = self.proc.stdout.readline().decode(errors="replace").strip()
                if line:
                    answer = json.loads(line)
                    assert "error" not in answer, f"{answer['error']} (see {self.log_path})"
                    self.pids.update(answer["pids"])
                    return answer
            assert self.proc.poll() is None, (
                f"the keeper exited with code {self.proc.returncode} (see {self.log_path})")
        raise AssertionError(f"the keeper did not answer in {ANSWER_SECONDS:g} s "
                             f"(see {self.log_path})")

    def processes(self) -> list:
        """The keeper and every process it started (Ray's head, raylets, workers), now."""
        try:
            keeper = psutil.Process(self.proc.pid)
            return [keeper, *keeper.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        """SIGTERM to the keeper (by pid): it kills every process of the cluster."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


@contextlib.contextmanager
def started_keeper(tmp_path_factory, name: str, **environ):
    """A keeper of a cluster of its own (``environ``: on top of this process's, for every
    node). At the end, whatever the test left: the notebook leaves Ray, then the cluster
    goes, by pid; ``keeper.left`` is what is still alive 30 s later."""
    from colab_xla.notebook.cluster.local import local_addresses

    local_addresses()  # this driver on 127.0.0.1 too
    started = Keeper(str(tmp_path_factory.mktemp(name) / "keeper.log"), **environ)
    try:
        yield started
    finally:
        import ray

        ray.shutdown()
        mine = started.processes()
        started.stop()
        started.left = wait_until_gone(mine, timeout=30)


@pytest.fixture(scope="module")
def keeper(tmp_path_factory):
    with started_keeper(tmp_path_factory, "tpu-cluster") as started:
        yield started


def _connect(keeper: Keeper, announce=None, **kw):
    from colab_xla.notebook.cluster.connection import Cluster

    return Cluster.connect(keeper.address, announce=announce, **kw)


def _children() -> set:
    return {(p.pid, p.create_time()) for p in psutil.Process().children()}


def _assert_left_ray(ray, before: set) -> None:
    """A refused connect leaves Ray as it found it, and no process of its own (``before``:
    this process's children before it; earlier tests' may still be there)."""
    assert not ray.is_initialized()
    assert _children() - before == set()


@pytest.mark.timeout(300)
def test_a_slice_is_refused_clearly_when_no_node_is_a_tpu_host(keeper):
    import ray

    # First in this module: the cluster has its head only (no TPU hosts yet).
    assert keeper.workers is None, "run this test before the TPU hosts are added"
    before = _children()
    with pytest.raises(ClusterError) as refused:
        _connect(keeper)
    assert str(refused.value) == (
        f"this Ray cluster has no TPU slice (no node labelled {SLICE_LABEL}). For hosts "
        "without TPUs, give their count and replicas per host: %xla_cluster connect "
        "ADDRESS --hosts H -n N.")
    with pytest.raises(ClusterError, match="^this Ray cluster has no TPU slice"):
        _connect(keeper, slice_name=SLICE)  # asked by name: the same answer
    _assert_left_ray(ray, before)


@pytest.mark.timeout(300)
def test_a_slice_asked_by_a_name_the_cluster_lacks_is_refused_naming_those_it_has(keeper):
    import ray

    keeper.add_tpu_hosts(HOSTS)
    before = _children()
    with pytest.raises(ClusterError) as refused:
        _connect(keeper, slice_name="my-v5e-16")
    assert str(refused.value) == ("no TPU slice named 'my-v5e-16' in this Ray cluster; it "
                                  f"has {SLICE}.")
    _assert_left_ray(ray, before)
    # Refused before anything was reserved: no placement group was made.
    ray.init(address=keeper.address, log_to_driver=False, logging_level="ERROR")
    try:
        from ray.util import placement_group_table

        assert [g["state"] for g in placement_group_table().values()] == []
    finally:
        ray.shutdown()


@pytest.mark.timeout(300)
def test_a_slice_is_found_reserved_and_ranked_by_worker_id_with_each_hosts_environment(
        keeper):
    import ray
    from ray.util import placement_group_table
    from ray.util.tpu import SlicePlacementGroup

    def agent_state(agent):
        """In the agent (a nested function: Ray sends it by value): its node, and its own
        TPU variables."""
        import ray

        return (ray.get_runtime_context().get_node_id(),
                {k: v for k, v in os.environ.items() if k.startswith("TPU_")})

    workers = keeper.add_tpu_hosts(HOSTS)
    assert sorted(workers.values()) == list(range(HOSTS))
    started = time.monotonic()
    said = []
    connected = _connect(keeper, announce=said.append)
    try:
        connect_seconds = time.monotonic() - started
        # This keeper's cluster runs without Ray's token authentication: said, in one line.
        from colab_xla.notebook.cluster.connection import AUTH_OFF_WARNING

        assert said[-1] == AUTH_OFF_WARNING.format(address=keeper.address), said
        assert "\n" not in said[-1] and "token authentication off" in said[-1]
        # The slice Ray made of the nodes' variables, its hosts ranked by worker id.
        assert connected.slice_name == SLICE
        hosts = connected.hosts
        assert [h.rank for h in hosts] == list(range(HOSTS))
        assert [workers[h.node_id] for h in hosts] == list(range(HOSTS))
        assert [h.address for h in hosts] == [f"127.0.0.{10 + w}" for w in range(HOSTS)]
        assert {(h.device, h.chips) for h in hosts} == {("TPU", 4)}
        labels = {n["NodeID"]: n["Labels"] for n in ray.nodes() if n["Alive"]}
        assert [labels[h.node_id][WORKER_LABEL] for h in hosts] == ["0", "1"]

        # Reserved once, as Ray's SlicePlacementGroup, one bundle per host; bundle 0 is
        # not host 0 here (worker 1 was added first), which the ranks do not follow.
        [placement] = connected.placements
        assert isinstance(placement, SlicePlacementGroup)
        table = placement_group_table(placement.placement_group)
        assert table["state"] == "CREATED" and len(table["bundles"]) == HOSTS
        assert all(b.get("TPU") == 4 for b in table["bundles"].values())
        assert set(table["bundles_to_node_id"].values()) == {h.node_id for h in hosts}
        bundle_workers = [workers[table["bundles_to_node_id"][b]] for b in range(HOSTS)]
        print(f"bundles' worker ids: {bundle_workers}; connect took {connect_seconds:.1f} s")

        # One agent per host, up on its host's node, describing itself.
        assert len(connected.agents) == HOSTS and connected.up
        for rank, (host, agent, described) in enumerate(
                zip(hosts, connected.agents, connected.described)):
            assert described == ray.get(agent.describe.remote(), timeout=60)
            assert described["host"] == rank and described["device"] == "TPU"
            assert described["address"] == host.address and described["store"] is None
            assert psutil.pid_exists(described["pid"])
            assert described["pid"] in {p.pid for p in keeper.processes()}
            assert described["replicas"] == 4  # one per v4 chip: global ordinals count them
            # The agent's node and own environment: Ray's __ray_call__ runs a function on
            # the actor instance. What the replicas get on top, the agent describes.
            node, environ = ray.get(agent.__ray_call__.remote(agent_state), timeout=60)
            assert node == host.node_id
            env = described["env"]
            assert env == {"TPU_WORKER_ID": str(rank),
                           "TPU_WORKER_HOSTNAMES": ",".join(h.address for h in hosts)}
            assert env["TPU_WORKER_HOSTNAMES"] == "127.0.0.10,127.0.0.11"
            assert environ["TPU_WORKER_ID"] == str(rank)  # the node's own, agreeing
            assert not set(environ) & set(PER_CHIP), environ  # dropped for the replicas
        assert connected.replicas == 8
        text = connected.describe()
        assert text.startswith("colab_xla cluster: up · 2 hosts · 8 replicas · "), text
        assert f"{SLICE} · {keeper.address}" in text, text
        assert "host 1: 127.0.0.11" in text and "4 TPU replicas" in text
    finally:
        agent_pids = [d["pid"] for d in connected.described]
        connected.stop()

    # Stopped: agents gone, the slice released, Ray left; then the cluster, by pid.
    assert not connected.up and not ray.is_initialized()
    gone, alive = psutil.wait_procs(
        [psutil.Process(p) for p in agent_pids if psutil.pid_exists(p)], timeout=30)
    assert alive == []
    ray.init(address=keeper.address, log_to_driver=False, logging_level="ERROR")
    try:
        assert {g["state"] for g in placement_group_table().values()} <= {"REMOVED"}
    finally:
        ray.shutdown()
    mine = keeper.processes()
    keeper.stop()
    gone, alive = psutil.wait_procs(mine, timeout=30)
    assert alive == [], alive
    assert [p for p in keeper.pids | set(agent_pids) if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []


@pytest.mark.timeout(420)
def test_two_slices_are_one_multislice_job_each_host_with_fresh_megascale_variables(
        tmp_path_factory):
    import ray
    from ray.util import placement_group_table

    def agent_environ(agent):
        import os

        return {k: v for k, v in os.environ.items() if k.startswith("MEGASCALE_")}

    # Stale values from an earlier job in every host's environment: replaced, not kept.
    stale = {"MEGASCALE_SLICE_ID": "5", "MEGASCALE_NUM_SLICES": "9",
             "MEGASCALE_COORDINATOR_ADDRESS": "10.9.9.9", "MEGASCALE_PORT": "1"}
    with started_keeper(tmp_path_factory, "multislice", **stale) as keeper:
        connected = None
        try:
            # Added b first (its hosts on 127.0.0.*, a's on 127.0.1.*): ranked by name anyway.
            for name in ("fake-b", "fake-a"):
                keeper.add_slice(HOSTS, name)
            connected = _connect(keeper)
            assert connected.slice_name == "fake-a,fake-b"
            assert connected.slices == multislice.Slices(2, HOSTS, "127.0.1.10")
            a, b = ["127.0.1.10", "127.0.1.11"], ["127.0.0.10", "127.0.0.11"]
            assert [h.address for h in connected.hosts] == a + b
            assert len(connected.placements) == 2
            for placement in connected.placements:  # one reservation per slice
                table = placement_group_table(placement.placement_group)
                assert table["state"] == "CREATED" and len(table["bundles"]) == HOSTS
            envs = [d["env"] for d in connected.described]
            assert [(e["MEGASCALE_SLICE_ID"], e["TPU_WORKER_ID"], e["TPU_WORKER_HOSTNAMES"])
                    for e in envs] == [
                ("0", "0", ",".join(a)), ("0", "1", ",".join(a)),
                ("1", "0", ",".join(b)), ("1", "1", ",".join(b))]
            assert {(e["MEGASCALE_COORDINATOR_ADDRESS"], e["MEGASCALE_PORT"],
                     e["MEGASCALE_NUM_SLICES"]) for e in envs} == {("127.0.1.10", "8081", "2")}
            for agent in connected.agents:  # the agent's own stale ones are gone
                assert ray.get(agent.__ray_call__.remote(agent_environ), timeout=60) == {}
            assert "fake-a,fake-b · 2 slices (multislice)" in connected.describe()
        finally:
            if connected is not None:
                connected.stop()
    assert keeper.left == []
