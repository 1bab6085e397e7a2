"""``%xla_cluster local`` on a machine two users share (tests/_two_users.py): the other user
knows the cluster's address (anyone can: ``ps`` shows Ray's command lines, and Ray wrote it
to the world-readable ``/tmp/ray/ray_current_cluster`` before), and must not get to run code
on it, which Ray runs as the cluster's owner; nor break it by making ``/tmp/ray`` first.

One local cluster of one host per test (two here): they are slow to start on two cores.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray (colab_xla[ray]) is not installed in this stack")
pytestmark = [needs_ray, pytest.mark.shared_machine, pytest.mark.cluster]

LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's nodes here are on 127.0.0.1
START = "%xla_cluster local --hosts 1 -n 1"
ADDRESS = "__import__('colab_xla.notebook.cluster', fromlist=['c']).current().address"
DIRECTORY = "__import__('colab_xla.notebook.cluster', fromlist=['c']).current().local.directory"

# The attacker's driver: a task on the victim's node that writes a file (as whoever runs it).
# The attack: a node of the neighbour's (a raylet, as ``ray start --address`` makes one, in
# a temporary directory of its own), its driver on it, and a task pinned to the victim's
# host's node that writes a file there, as whoever runs it.
ATTACK = """
import os, tempfile
os.environ["RAY_event_log_reporter_enabled"] = "0"  # (the victim's session's, unwritable)
import ray
from ray._private.node import Node
from ray._private.parameter import RayParams
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

mine = tempfile.mkdtemp()
params = RayParams(gcs_address={address!r}, num_cpus=0, object_store_memory=128 * 2**20,
                   include_log_monitor=False, node_manager_port=0, min_worker_port=0,
                   max_worker_port=0, temp_dir=mine)
node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
print("JOINED", flush=True)
ray.init(address={address!r}, log_to_driver=False, _temp_dir=mine)
[victims] = [n["NodeID"] for n in ray.nodes()
             if n["Alive"] and n["NodeID"] != node.node_id and n["Resources"].get("CPU")]

@ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(victims, soft=False))
def plant():
    with open("/tmp/planted-by-the-neighbour", "w") as f:
        f.write("ran")
    return os.getuid()

print("RAN AS", ray.get(plant.remote(), timeout=120), flush=True)
"""


def _cell_on_the_cluster_works(book) -> None:
    ran = book.run("%%xla_spawn -o outs\n(index, host)", then="outs")
    assert ran["ok"] and ran["value"] == {"0": [0, 0]}, ran


@pytest.mark.timeout(900)
def test_the_neighbour_who_knows_the_address_is_refused_and_the_victims_cluster_works(
        two_users):
    m = two_users
    book = m.notebook(m.victim)
    try:
        started = book.run(START, then=ADDRESS)
        assert started["ok"], started
        address = started["value"]

        # The neighbour's node and driver: refused, and nothing of theirs ran.
        attack = m.python(m.attacker, ATTACK.format(address=address), env=LOOPBACK,
                          timeout=300, check=False)
        assert "RAN AS" not in attack.stdout and "JOINED" not in attack.stdout, attack.stdout
        assert attack.returncode != 0 and "AuthenticationError" in attack.stderr, (
            attack.stderr[-3000:])
        planted = m.python(None, "import os; print(os.path.exists("
                           "'/tmp/planted-by-the-neighbour'))")
        assert planted.stdout.split() == ["False"]

        # Nor can the neighbour read the token, or Ray's files.
        directory = book.run("", then=DIRECTORY)["value"]
        peek = m.python(m.attacker, f"""
            import os
            for path in ({directory!r}, os.path.join({directory!r}, "token")):
                try:
                    os.listdir(path) if os.path.isdir(path) else open(path).read()
                    print("read", path)
                except PermissionError:
                    print("refused")
            """)
        assert peek.stdout.split() == ["refused", "refused"], peek.stdout

        # The victim's cluster goes on: a cell on it, then stopped, its files gone.
        _cell_on_the_cluster_works(book)
        stopped = book.run("%xla_cluster stop")
        assert stopped["ok"], stopped
        left = m.python(None, f"import os; print(os.path.exists({directory!r}))")
        assert left.stdout.split() == ["False"]
    finally:
        book.run("%xla_cluster stop")
        book.close()


@pytest.mark.timeout(900)
def test_a_tmp_ray_the_neighbour_made_first_does_not_break_or_feed_the_victims_cluster(
        two_users):
    m = two_users
    m.python(m.attacker, """
        import os
        os.mkdir("/tmp/ray"); os.chmod("/tmp/ray", 0o777)
        with open("/tmp/ray/ray_current_cluster", "w") as f:
            f.write("127.0.0.1:1")
        os.chmod("/tmp/ray/ray_current_cluster", 0o666)
        """)
    book = m.notebook(m.victim)
    try:
        started = book.run(START, then=ADDRESS)
        assert started["ok"], started
        assert started["value"] != "127.0.0.1:1"
        _cell_on_the_cluster_works(book)
        # Nothing of the victim's went to the neighbour's /tmp/ray.
        there = m.python(None, """
            import json, os
            print(json.dumps({"names": sorted(os.listdir("/tmp/ray")),
                              "address": open("/tmp/ray/ray_current_cluster").read()}))
            """)
        assert json.loads(there.stdout) == {"names": ["ray_current_cluster"],
                                            "address": "127.0.0.1:1"}
    finally:
        book.run("%xla_cluster stop")
        book.close()
