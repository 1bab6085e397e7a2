"""``%xla_cluster`` when things go wrong: a host gone mid-cell, and the notebook's process
killed. Each test starts its own local cluster (a notebook connects to one at a time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from colab_xla.notebook import cluster
from colab_xla.notebook.outcome import FAILED, STOPPED, RunObserver
from _kernel import wait_until_gone  # tests/ is on sys.path
from test_chaos import run_stream
from test_cluster import HOSTS, needs_ray, on_cluster

pytestmark = [needs_ray, pytest.mark.cluster, pytest.mark.timeout(300)]


def test_a_host_that_is_gone_mid_cell_fails_its_replicas_stops_the_others_and_ends_the_connection():
    c = cluster.start_local(HOSTS, 1, announce=None)
    try:
        agent_pid = c.described[1]["pid"]

        class KillHost1(RunObserver):
            def started(self, outcome, ordinal):
                if ordinal == 1:
                    psutil.Process(agent_pid).kill()

        outcome = on_cluster("import time\ntime.sleep(120)", c, observer=KillHost1())
        assert outcome.replicas[1].state == FAILED
        assert outcome.replicas[1].error.ename == "HostDied"
        assert "host 1 (127.0.0.1) is gone" in outcome.replicas[1].error.evalue
        assert outcome.replicas[0].state == STOPPED
        assert "after replica 1 failed (HostDied)" in outcome.replicas[0].error.evalue
        assert not c.up and "host 1 is gone" in c.ended
        with pytest.raises(cluster.ClusterError, match="connection ended"):
            on_cluster("index", c)
        replica_pids = [r.pid for r in outcome.replicas.values() if r.pid]
        assert wait_until_gone([psutil.Process(p) for p in replica_pids
                                if psutil.pid_exists(p)], timeout=15) == []
    finally:
        cluster.stop()
        c.stop()
    # Ray's files and the token went with the cluster; this process's token settings too.
    assert not os.path.exists(c.local.directory)
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ and "RAY_AUTH_MODE" not in os.environ


def test_a_ray_node_lost_during_a_session_cell_ends_the_session_and_leaves_nothing_of_it():
    """Host 1's whole Ray node goes (its raylet SIGKILLed, as when a host of a slice is
    preempted) while a session cell runs: the cell answers in bounded time, host 1's
    replicas failed and the others were stopped, the session and the connection end, and
    no replica process of the session is left on either host."""
    from colab_xla.notebook.targets.cluster_session import ClusterSession

    c = cluster.start_local(HOSTS, 1, announce=None)
    try:
        c.session = ClusterSession.start(c, announce=None)
        pids = [pid for replicas in c.session.replicas.values() for pid in replicas.values()]
        raylet = psutil.Process(c.described[1]["pid"]).parent()  # host 1's node
        assert "raylet" in raylet.name(), raylet.cmdline()

        class LoseNode1(RunObserver):
            def started(self, outcome, ordinal):
                if ordinal == 1:
                    raylet.kill()

        outcome = on_cluster("import time\ntime.sleep(120)", c, observer=LoseNode1())
        assert outcome.elapsed < 60, outcome.elapsed
        assert outcome.replicas[1].state == FAILED
        assert outcome.replicas[1].error.ename == "HostDied", outcome.replicas[1].error
        assert outcome.replicas[0].state == STOPPED
        assert not c.up and "host 1 is gone" in c.ended
        with pytest.raises(cluster.ClusterError, match="connection ended"):
            on_cluster("index", c)
        assert wait_until_gone([psutil.Process(p) for p in pids if psutil.pid_exists(p)],
                               timeout=15) == []
    finally:
        cluster.stop()
        c.stop()


DIES = """
import json, sys
from colab_xla.notebook import cluster
from colab_xla.notebook.targets.cluster_one_off import run_on_cluster
import psutil
c = cluster.start_local(2, 1, announce=None)
outcome = run_on_cluster(c, "index", announce=None)
pids = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps({"pids": pids + [r.pid for r in outcome.replicas.values()],
                  "ok": outcome.ok, "directory": c.local.directory}), flush=True)
sys.stdin.read()
"""


def test_nothing_of_a_local_cluster_outlives_a_killed_notebook_process():
    notebook = subprocess.Popen([sys.executable, "-c", DIES], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env={**os.environ, "PJRT_DEVICE": "CPU"})
    try:
        said = json.loads(notebook.stdout.readline())
    finally:
        notebook.kill()
        notebook.wait()
    assert said["ok"]
    started = [psutil.Process(p) for p in said["pids"] if psutil.pid_exists(p)]
    assert len(said["pids"]) > HOSTS + 3  # keeper, Ray's head and nodes, agents, replicas
    assert wait_until_gone(started, timeout=30) == []
    assert os.path.isabs(said["directory"]) and not os.path.exists(said["directory"])


@pytest.mark.faults
@pytest.mark.timeout(1200)
def test_a_seeded_stream_of_faults_on_a_cluster_leaves_every_next_cell_working(tmp_path):
    """tests/test_chaos.py's stream on a 2-host local cluster, host 1's agent killed as
    its SIGKILL (here, with the other Ray tests: two clusters at once time out)."""
    run_stream(tmp_path, "cluster")
