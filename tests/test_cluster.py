"""``%xla_cluster``: every host of a cluster through Ray.

Units first (which hosts, ranks, labels, the refusals), then a real local cluster of 2
CPU hosts x 2 replicas (:func:`colab_xla.notebook.cluster.start_local`): ordinals, notebook
names and classes across hosts, collectives spanning hosts, fail-fast, timeout,
Interrupt, a host that is gone, and nothing left behind, also when the notebook's
process is killed (those two in test_cluster_faults.py: they need this module's
cluster gone).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import tempfile
import textwrap
import threading

import psutil
import pytest
from IPython.core.error import UsageError

from colab_xla.notebook import cluster, interrupts
from colab_xla.notebook.cluster import multislice
from colab_xla.notebook.cluster import hosts
from colab_xla.notebook.cluster.agent import STALE_VARIABLES, _HostedRun, host_environment
from colab_xla.errors import SetupError
from colab_xla.wire.host_rank import HostRank
from colab_xla.notebook.outcome import (DONE, FAILED, STOPPED, RunObserver, RunOutcome,
                                       XlaSpawnError)
from colab_xla.notebook.views import text as text_view
from _kernel import replicas_left, wait_until_gone  # tests/ is on sys.path
from _shell import get_ipython, ip_fixture
from test_jax_runtime import needs_jax
from test_launch import notebook_namespace


# -- units ---------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("rfc3987_syntax") is None,
                    reason="rfc3987_syntax is not installed: nothing to leave out")
def test_a_local_clusters_ray_processes_leave_out_rfc3987_syntax_and_keep_the_path(
        monkeypatch, tmp_path):
    """Ray's processes import jsonschema, which imports rfc3987_syntax if it can (2 s of CPU,
    most of ``import ray``): the keeper's environment, which they inherit, makes that import
    fail, and keeps the PYTHONPATH it was given after it. The same import without that
    environment takes the package (the test sees what it claims to change)."""
    import subprocess
    import sys

    from colab_xla.notebook.cluster import local

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/given/one", "/given/two"]))
    environ = local.ray_environment(str(tmp_path), str(tmp_path / "token"))
    path = environ["PYTHONPATH"].split(os.pathsep)
    assert path[1:] == ["/given/one", "/given/two"] and path[0].endswith("lean_imports")
    probe = ("import sys, jsonschema._format as f; "
             "print('rfc3987_syntax' in sys.modules, 'iri' in f.draft7_format_checker.checkers)")

    def imported(env):
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert imported(environ) == ["False", "False"]
    assert imported({**os.environ, "PYTHONPATH": ""}) == ["True", "True"]
    # What the refusal tells a cell that needs the package works.
    advice = ("import sys\n"
              "try:\n    import rfc3987_syntax\nexcept ImportError as e:\n    said = str(e)\n"
              "exec(said[said.index('sys.path[:]'):])\n"
              "import rfc3987_syntax\nprint(rfc3987_syntax.is_valid_syntax is not None)")
    done = subprocess.run([sys.executable, "-c", advice], env=environ, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split() == ["True"], done.stderr


def test_the_directories_of_local_clusters_whose_notebook_is_gone_are_swept(tmp_path):
    """A keeper killed with its notebook (SIGKILL: no clean-up) leaves its cluster's
    directory; the next local cluster removes it, and nothing that is not such a directory
    of a notebook that is gone: a live notebook's, one without the file that names its
    notebook, a link."""
    from colab_xla.notebook import state
    from colab_xla.notebook.cluster import local

    parent = state.state_dir()

    def made(name, key=None):
        path = os.path.join(parent, name)
        os.mkdir(path, 0o700)
        if key is not None:
            with open(os.path.join(path, "notebook"), "w") as f:
                f.write(key)
        return path

    gone = made("ray-test-gone", "1-1.00")  # pid 1 did not start at that time
    alive = made("ray-test-alive", state.kernel_key())
    unnamed = made("ray-test-unnamed")
    target = tmp_path / "target"
    target.mkdir()
    (target / "notebook").write_text("1-1.00")
    link = os.path.join(parent, "ray-test-link")
    os.symlink(target, link)
    try:
        local.sweep()
        assert not os.path.exists(gone)
        assert os.path.isdir(alive) and os.path.isdir(unnamed)
        assert os.path.islink(link) and (target / "notebook").exists()
    finally:
        for path in (gone, alive, unnamed):
            shutil.rmtree(path, ignore_errors=True)
        os.unlink(link)


def test_a_local_clusters_directory_is_private_named_and_short_enough_for_rays_sockets(
        monkeypatch, tmp_path):
    """Ray's longest socket in the directory fits a Unix socket's path (107 bytes) where
    the state directory is short; where it is too long, the directory is made in /tmp,
    private all the same."""
    from colab_xla.notebook import state
    from colab_xla.notebook.cluster import local

    tail = "/ray/session_2026-12-01_20-53-13_910160_" + str(local._pid_max()) \
        + "/sockets/plasma_store.12"
    made, parents = [], (state.state_dir(), str(tmp_path / ("x" * 60)))
    for parent in parents:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        monkeypatch.setattr(state, "state_dir", lambda parent=parent: parent)
        directory = local.private_directory(hosts=12)
        made.append(directory)
        info = os.lstat(directory)
        assert oct(info.st_mode & 0o777) == "0o700" and info.st_uid == os.getuid()
        assert len((directory + tail).encode()) <= state.MAX_SOCKET_PATH, directory
        with open(os.path.join(directory, "notebook")) as f:
            assert f.read() == state.kernel_key()
    try:
        in_state_dir = os.path.join(parents[0], local.DIRECTORY_PREFIX + "x" * 8)
        if len((in_state_dir + tail).encode()) <= state.MAX_SOCKET_PATH:  # a short TMPDIR
            assert os.path.dirname(made[0]) == parents[0]
            assert os.path.basename(made[0]).startswith(local.DIRECTORY_PREFIX)
        else:  # (scripts/test's TMPDIR is one such)
            assert os.path.dirname(made[0]) == "/tmp"
        assert os.path.dirname(made[1]) == "/tmp"
        assert os.path.basename(made[1]).startswith(local.FALLBACK_PREFIX)
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)


def test_a_tpu_slice_is_ordered_by_worker_id_not_by_how_ray_lists_it():
    nodes = [hosts._tpu_node(f"n{w}", f"10.0.0.{w + 10}", w) for w in (2, 0, 3, 1)]
    [found] = hosts.tpu_slices(nodes)
    assert [h.address for h in found.hosts] == ["10.0.0.10", "10.0.0.11", "10.0.0.12",
                                                "10.0.0.13"]
    assert [h.rank for h in found.hosts] == [0, 1, 2, 3]
    assert {h.chips for h in found.hosts} == {4} and found.accelerator_version == "v4"


def test_a_tpu_slice_counts_a_replica_per_core_on_each_host():
    [v4] = hosts.tpu_slices([hosts._tpu_node("a", "10.0.0.2", 0),
                             hosts._tpu_node("b", "10.0.0.3", 1)])
    assert v4.replicas_per_host == 4  # 4 chips, one core each
    [v3] = hosts.tpu_slices([hosts._tpu_node("a", "10.0.0.2", 0, pod_type="v3-16")])
    assert v3.replicas_per_host == 8  # 2 cores a chip on v2/v3


def test_slices_that_cannot_be_used_are_refused_with_what_to_do():
    with pytest.raises(hosts.ClusterError, match="no TPU slice.*--hosts H -n N"):
        hosts.tpu_slices([{"NodeID": "x", "NodeManagerAddress": "1.2.3.4", "Alive": True,
                           "Resources": {"CPU": 4}, "Labels": {}}])
    two = [hosts._tpu_node("a", "10.0.0.1", 0, "v4-16"), hosts._tpu_node("b", "10.0.0.2", 0,
                                                                          "v5e-16")]
    with pytest.raises(hosts.ClusterError, match=r"multislice job must be alike; these are "
                       r"my-v4-16 \(v4-16, 1 hosts\), my-v5e-16 \(v5e-16, 1 hosts\)\. "
                       r"Choose alike ones with --slice NAME,NAME"):
        hosts.tpu_slices(two)
    assert [s.pod_type for s in hosts.tpu_slices(two, ["my-v5e-16"])] == ["v5e-16"]
    with pytest.raises(hosts.ClusterError, match="no TPU slice named 'other'"):
        hosts.tpu_slices(two, ["my-v4-16", "other"])
    missing = [hosts._tpu_node("a", "10.0.0.1", 0), hosts._tpu_node("c", "10.0.0.3", 2)]
    with pytest.raises(hosts.ClusterError, match=r"worker ids \[0, 2\].*missing"):
        hosts.tpu_slices(missing)
    dead = dict(hosts._tpu_node("b", "10.0.0.2", 1), Alive=False)
    with pytest.raises(hosts.ClusterError, match=r"worker ids \[0, 2\]"):  # 1 is dead
        hosts.tpu_slices([hosts._tpu_node("a", "10.0.0.1", 0), dead, missing[1]])


def test_several_tpu_slices_are_one_job_ranked_slice_by_slice_each_by_worker_id():
    nodes = [hosts._tpu_node(f"{name}{w}", f"10.{k}.0.{w}", w, slice_name=name)
             for k, name in ((1, "s-b"), (0, "s-a")) for w in (1, 0)]
    found = hosts.tpu_slices(nodes)
    assert [s.name for s in found] == ["s-a", "s-b"]
    assert [(h.rank, h.address) for s in found for h in s.hosts] == [
        (0, "10.0.0.0"), (1, "10.0.0.1"), (2, "10.1.0.0"), (3, "10.1.0.1")]
    assert [h.address for h in hosts.tpu_slices(nodes, ["s-b"])[0].hosts] == [
        "10.1.0.0", "10.1.0.1"]  # one chosen: ranked from 0


def test_each_host_of_two_slices_of_two_gets_its_megascale_variables_and_its_slices_workers():
    layout = multislice.Slices(count=2, hosts_per_slice=2, coordinator="10.0.0.0")
    names = ["10.0.0.0", "10.0.0.1", "10.1.0.0", "10.1.0.1"]
    stale = {"MEGASCALE_SLICE_ID": "7", "MEGASCALE_NUM_SLICES": "9",
             "MEGASCALE_COORDINATOR_ADDRESS": "old", "MEGASCALE_PORT": "1", "HOME": "/root",
             "SKIP_MEGASCALE_PJRT_CLIENT": "true"}  # a first client must discover
    seen = []
    for host in range(4):
        environ = dict(stale)
        env = host_environment(environ, HostRank(host, 4, 4, names[host]), "TPU", names, layout)
        assert environ == {"HOME": "/root"}  # the stale ones dropped from the agent's own
        seen.append(env)
    assert [(e["MEGASCALE_SLICE_ID"], e["TPU_WORKER_ID"], e["TPU_WORKER_HOSTNAMES"])
            for e in seen] == [("0", "0", "10.0.0.0,10.0.0.1"), ("0", "1", "10.0.0.0,10.0.0.1"),
                               ("1", "0", "10.1.0.0,10.1.0.1"), ("1", "1", "10.1.0.0,10.1.0.1")]
    assert {(e["MEGASCALE_COORDINATOR_ADDRESS"], e["MEGASCALE_PORT"], e["MEGASCALE_NUM_SLICES"])
            for e in seen} == {("10.0.0.0", "8081", "2")}
    cpu = host_environment({}, HostRank(3, 4, 2), "CPU", names, layout)
    assert cpu == {"PJRT_DEVICE": "CPU", **layout.environ(3)} and cpu["MEGASCALE_SLICE_ID"] == "1"
    # One slice: none of them, stale values dropped all the same.
    environ = dict(stale)
    assert host_environment(environ, HostRank(0, 2, 2), "CPU", names[:2]) == {"PJRT_DEVICE": "CPU"}
    assert environ == {"HOME": "/root"}


def test_slices_of_cpu_hosts_must_divide_the_hosts():
    assert multislice.split(4, None, "a") is None and multislice.split(4, 1, "a") is None
    assert multislice.split(6, 3, "a") == multislice.Slices(3, 2, "a")
    for slices in (3, 0, -2):
        with pytest.raises(SetupError, match=rf"--slices {slices}: give a number of slices "
                                             r"that divides the hosts \(4\)"):
            multislice.split(4, slices, "a")
    with pytest.raises(hosts.ClusterError, match="--slices is for CPU hosts"):
        cluster.Cluster.connect("auto", slices=2)


def test_cpu_hosts_need_enough_nodes_with_a_cpu():
    nodes = [{"NodeID": "h", "NodeManagerAddress": "1", "Resources": {}},
             {"NodeID": "a", "NodeManagerAddress": "2", "Resources": {"CPU": 1}}]
    assert hosts.cpu_hosts(nodes, 1) == 1
    with pytest.raises(hosts.ClusterError, match="--hosts 2 needs 2 Ray nodes with a CPU; "
                                                 "this cluster has 1"):
        hosts.cpu_hosts(nodes, 2)
    ordered = hosts.ordered_by_bundle({1: "a", 0: "h"}, nodes)
    assert [(h.rank, h.node_id, h.device) for h in ordered] == [(0, "h", "CPU"), (1, "a", "CPU")]


def test_a_host_rank_travels_as_environment_and_counts_global_ordinals():
    rank = HostRank(2, 3, 4, "10.0.0.5", "10.0.0.1:123", "run")
    assert [rank.index(i) for i in range(4)] == [8, 9, 10, 11] and rank.world == 12
    assert HostRank.from_environ({**os.environ, **rank.environ()}) == rank
    assert HostRank.from_environ({}) is None


def test_a_hosts_replicas_get_its_worker_id_and_none_of_rays_per_chip_variables():
    rank = HostRank(1, 2, 4, "10.0.0.3")
    environ = {"TPU_VISIBLE_CHIPS": "0,1,2,3", "TPU_HOST_BOUNDS": "1,1,1", "HOME": "/root",
               **HostRank(0, 9, 9, "stale").environ()}
    tpu = host_environment(environ, rank, "TPU", ["10.0.0.2", "10.0.0.3"])
    assert tpu == {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}
    assert environ == {"HOME": "/root"} and not set(environ) & set(STALE_VARIABLES)
    assert host_environment({}, rank, "CPU", []) == {"PJRT_DEVICE": "CPU"}


def test_a_jax_process_on_a_host_is_its_global_ordinal_among_every_hosts_processes(
        monkeypatch):
    from types import SimpleNamespace

    from colab_xla.runtimes import jax as jax_runtime, torch_xla as torch_xla_runtime
    from colab_xla.notebook.cluster.agent import HostAgent
    from colab_xla.notebook.targets.cluster_run import host_request, replicas_per_host
    from colab_xla.errors import OptionError
    from colab_xla.notebook.launch import Launch

    monkeypatch.setattr(jax_runtime, "_membership", None)
    local_rank = {"PJRT_LOCAL_PROCESS_RANK": "2", "PJRT_LOCAL_PROCESS_COUNT": "3"}
    jax_runtime.join({**HostRank(1, 2, 3, "10.0.0.3").environ(), **local_rank,
                      jax_runtime.COORDINATOR: "10.0.0.2:1234"})
    # host 1's third of 2 x 3; gloo listens on the host's address (its peers are on others)
    assert jax_runtime._membership == ("10.0.0.2:1234", 6, 5, "10.0.0.3")
    jax_runtime.join({**local_rank, jax_runtime.COORDINATOR: "unix:/run/c"})  # one host
    assert jax_runtime._membership == ("unix:/run/c", 3, 2, "127.0.0.1")

    slice_ = SimpleNamespace(described=[{"device": "TPU", "replicas": 4}] * 2)
    asked = []
    monkeypatch.setattr("colab_xla.notebook.targets.cluster_run.coordinator",
                        lambda cluster: asked.append(cluster) or "10.0.0.2:5")
    jax = host_request(slice_, Launch(runtime="jax"))
    assert jax == {"runtime": "jax", "devices_per_process": None,
                   "environ": {jax_runtime.COORDINATOR: "10.0.0.2:5"}} and asked == [slice_]
    torch_xla = host_request(slice_, Launch())
    assert torch_xla == {"runtime": "torch_xla", "devices_per_process": None, "environ": {}}
    assert asked == [slice_]  # (torch_xla's replicas meet through host 0's store)

    tpu = HostAgent.__new__(HostAgent)  # (its __init__ imports torch_xla: not needed here)
    tpu.env, tpu.device, tpu.start_method = {}, "TPU", "fork"
    tpu.rank = HostRank(1, 2, 4, "10.0.0.3")
    env = tpu._environ("run", jax)
    jax_runtime.join({**env, "PJRT_LOCAL_PROCESS_RANK": "0", "PJRT_LOCAL_PROCESS_COUNT": "1"})
    assert jax_runtime._membership[:3] == ("10.0.0.2:5", 2, 1)  # one process per TPU host
    assert tpu._launch(jax).runtime is jax_runtime.RUNTIME
    assert tpu._launch(jax) == Launch("fork", runtime="jax")
    # A torch_xla cell's: the host's own replicas and rank, as before there was a runtime.
    for request in (None, torch_xla):
        assert tpu._environ("run", request) == {
            **HostRank(1, 2, 4, "10.0.0.3", run="run").environ()}
        assert jax_runtime.COORDINATOR not in tpu._environ("run", request)
        assert tpu._launch(request) == Launch("fork")
        assert tpu._launch(request).runtime is torch_xla_runtime.RUNTIME

    assert replicas_per_host(slice_, jax_runtime.RUNTIME) == [1, 1]
    assert replicas_per_host(slice_, torch_xla_runtime.RUNTIME) == [4, 4]
    with pytest.raises(OptionError, match="--devices-per-process 2: on a TPU host the JAX "
                                          "runtime runs one process driving every chip"):
        jax_runtime.RUNTIME.check_cluster(slice_.described,
                                          Launch(runtime="jax", devices_per_process=2))
    jax_runtime.RUNTIME.check_cluster([{"device": "CPU", "replicas": 2}],
                                      Launch(runtime="jax", devices_per_process=2))


def test_an_interrupt_asked_from_another_thread_reaches_the_block_that_holds_it():
    remote = interrupts.Remote()
    with interrupts.held(remote) as held:
        assert not held.requested
        threading.Thread(target=remote.request).start()
        import select
        assert select.select([held.wake_fd], [], [], 10)[0] == [held.wake_fd]
        assert held.requested
    early = interrupts.Remote()
    early.request()  # before the run holds it: the run starts interrupted
    with interrupts.held(early) as held:
        assert held.requested


def test_a_hosted_run_keeps_each_lines_stream_and_reports_its_end():
    run, outcome = _HostedRun(), RunOutcome("CPU")
    lines = outcome.replica(1).log.write("stdout", "a\n")
    run.output(outcome, 1, lines)
    lines = outcome.replica(1).log.write("stderr", "b\nc\n")
    run.output(outcome, 1, lines)
    outcome.replica(1).state = DONE
    run.finished(outcome, 1)
    reply = run.take(0)
    assert reply["events"][:2] == [("output", 1, [("stdout", "a")]),
                                   ("output", 1, [("stderr", "b"), ("stderr", "c")])]
    assert reply["events"][2][0] == "finished" and reply["events"][2][2]["state"] == DONE
    assert not reply["done"] and run.take(0) == {"events": [], "done": False}


def test_views_label_a_clusters_replicas_with_their_host():
    outcome = RunOutcome("CPU", hosts={0: 0, 1: 1})
    for ordinal in (0, 1):
        outcome.replica(ordinal).state = DONE
    assert outcome.label(1) == "host 1 · replica 1"
    assert "── host 1 · replica 1 · done" in text_view.render(outcome)
    assert RunOutcome("CPU").label(3) == "replica 3"


def test_the_doctor_says_whether_ray_is_there_for_a_cluster():
    from colab_xla.notebook.doctor import _cluster_fact

    assert _cluster_fact(None, None) == (
        "not connected (Ray not installed: pip install 'colab_xla[ray]')")
    assert _cluster_fact(None, "2.60.0") == (
        "not connected (Ray 2.60.0: %xla_cluster connect, or local)")


ip = ip_fixture(after=lambda shell: cluster.stop())


def test_the_magic_refuses_what_it_cannot_do_before_anything_starts(ip, capsys):
    ip.run_line_magic("xla_cluster", "")
    assert "not connected" in capsys.readouterr().out
    with pytest.raises(UsageError, match="needs --hosts H and -n N"):
        ip.run_line_magic("xla_cluster", "local --hosts 2")
    with pytest.raises(UsageError, match="--hosts 0: give 1 or more"):
        ip.run_line_magic("xla_cluster", "local --hosts 0 -n 2")
    with pytest.raises(UsageError, match="CPU hosts need both --hosts H and -n N"):
        ip.run_line_magic("xla_cluster", "connect auto -n 2")
    with pytest.raises(UsageError, match="stop takes no --hosts, -n: those are for "
                                         "%xla_cluster connect"):
        ip.run_line_magic("xla_cluster", "stop --hosts 2 -n 2")
    with pytest.raises(UsageError, match="local takes no --slice.*local takes --hosts, -n and "
                                         "--slices"):
        ip.run_line_magic("xla_cluster", "local --hosts 2 -n 2 --slice s")
    with pytest.raises(UsageError, match="--slices 3: give a number of slices that divides "
                                         r"the hosts \(2\)"):
        ip.run_line_magic("xla_cluster", "local --hosts 2 -n 2 --slices 3")
    with pytest.raises(UsageError, match="--slices 0: give 1 or more"):
        ip.run_line_magic("xla_cluster", "local --hosts 2 -n 2 --slices 0")
    ip.run_line_magic("xla_cluster", "stop")
    assert "none was connected" in capsys.readouterr().out


# -- a real local cluster ---------------------------------------------------------------------

# Ray is the optional extra colab_xla[ray]: the dev stack has it, the users' stacks do not.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray (colab_xla[ray]) is not installed in this stack")
HOSTS, PER_HOST = 2, 2


@pytest.fixture(scope="module")
def local():
    """A local cluster of 2 CPU hosts x 2 replicas, for the module's tests; its hosts
    simulate 2 slices of 1 host (MegaScale variables only: nothing on CPU reads them)."""
    connected = cluster.start_local(HOSTS, PER_HOST, slices=HOSTS, announce=None)
    yield connected
    cluster.stop()


def on_cluster(source: str, c, **kw):
    from colab_xla.notebook.targets.cluster_one_off import run_on_cluster

    return run_on_cluster(c, textwrap.dedent(source).lstrip("\n"), announce=None,
                          label="Cell In[3]", **kw)


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_each_hosts_forkserver_listens_in_its_agents_work_directory(local):
    # %xla_cluster stop ends the agents with ray.kill: a socket in a pymp-* directory of
    # their own stayed for good; in the agent's work directory, the next colab_xla
    # process's sweep removes it (docs/architecture.md).
    if len(tempfile.gettempdir()) > 40:
        pytest.skip("a TMPDIR too long for a socket's path in the work directory")
    for host in local.described:
        paths = [c.laddr for c in psutil.Process(host["forkserver"]).net_connections("unix")
                 if c.laddr]
        work = [os.path.dirname(path) for path in paths]
        assert paths and all(os.path.basename(os.path.dirname(w)) == "work"
                             and os.path.basename(w).startswith(f"{host['pid']}-")
                             for w in work), (host["pid"], paths)


def _cluster_processes(c) -> list:
    """The local cluster's keeper and every process it started (Ray's, the agents, ...)."""
    keeper = psutil.Process(c.local._keeper.pid)
    return [keeper] + keeper.children(recursive=True)


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_local_cluster_takes_its_token_only_and_keeps_its_files_in_a_private_directory(
        local, tmp_path):
    """Ray's token authentication is on for the head, every node, every host's worker and
    this driver, with a token of this cluster's in a 0600 file of a 0700 directory of this
    user's; Ray's sessions, sockets and address file are in that directory (not in Ray's
    default /tmp/ray), and its processes listen on 127.0.0.1 only. A driver without the
    token is refused."""
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    from colab_xla.notebook import state
    from colab_xla.notebook.cluster.connection import token_auth_on

    directory = local.local.directory
    info = os.lstat(directory)
    assert info.st_uid == os.getuid() and oct(info.st_mode & 0o777) == "0o700"
    assert os.path.dirname(directory) in (state.state_dir(), "/tmp"), directory
    token = os.lstat(local.local.token_path)
    assert os.path.dirname(local.local.token_path) == directory
    assert token.st_uid == os.getuid() and oct(token.st_mode & 0o777) == "0o600"
    with open(local.local.token_path) as f:
        assert len(f.read()) == 64
    assert is_token_auth_enabled() and os.environ["RAY_AUTH_TOKEN_PATH"] == local.local.token_path
    assert token_auth_on(ray, local.agents)  # every host's node, asked of its agent

    # Ray's files: the session, the address file ray.init("auto") reads, every socket.
    assert ray.get_runtime_context().get_temp_dir() == os.path.join(directory, "ray")
    with open(os.path.join(directory, "ray", "ray_current_cluster")) as f:
        assert f.read().strip() == local.address
    processes = _cluster_processes(local)
    agents = {d["pid"] for d in local.described}
    stores = {int(d["store"].rsplit(":", 1)[1].split("/")[0])  # host:port[/key]
              for d in local.described if d["store"]}
    work = os.path.join(state.state_dir(), "work")  # the agents' forkservers' (a test above)
    sockets, listening = [], []
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            for conn in proc.net_connections("unix"):
                if conn.laddr and not conn.laddr.startswith(work):
                    sockets.append(conn.laddr)
            for conn in proc.net_connections("inet"):
                # (the host agents' TCPStore is agent.py's, not Ray's)
                if conn.status == psutil.CONN_LISTEN and not (
                        proc.pid in agents and conn.laddr.port in stores):
                    listening.append((proc.name(), conn.laddr))
    assert len({s for s in sockets if "/sockets/plasma_store" in s}) == HOSTS + 1, sockets
    assert all(s.startswith(directory + os.sep) for s in sockets), sockets
    assert listening and {addr.ip.removeprefix("::ffff:") for _, addr in listening} == {
        "127.0.0.1"}, listening  # (as an IPv4 address, or mapped in an IPv6 one)

    # A driver without the token (another user's, who read the address) is refused.
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    refused = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address={local.address!r}); "
         "print(ray.get(ray.remote(lambda: 'ran').remote()))"],
        env={**env, "HOME": str(tmp_path), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0 and "ran" not in refused.stdout
    assert "AuthenticationError" in refused.stderr, refused.stderr[-2000:]


# Defined as a notebook defines them (in __main__, which the hosts cannot import).
NOTEBOOK = notebook_namespace()


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_every_replica_of_every_host_runs_the_cell_with_its_global_ordinal(local):
    outcome = on_cluster("print(index, host, local_index)\n(index, host, local_index)", local)
    assert outcome.ok, text_view.render(outcome)
    expected = {h * PER_HOST + i: (h * PER_HOST + i, h, i)
                for h in range(HOSTS) for i in range(PER_HOST)}
    assert outcome.results() == expected
    assert outcome.hosts == {o: h for o, (_, h, _) in expected.items()}
    for ordinal, (index, host, local_index) in expected.items():
        assert outcome.replicas[ordinal].text == f"{index} {host} {local_index}"
    assert len({r.pid for r in outcome.replicas.values()}) == HOSTS * PER_HOST
    assert "── host 1 · replica 3 · done" in text_view.render(outcome)


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_each_hosts_replicas_fork_from_its_warm_forkserver_not_from_its_ray_worker(local):
    # (a child forked from the agent, a Ray worker with threads, may hang in libc; the
    # server was warm before the connection was up: see HostAgent)
    servers = [d["forkserver"] for d in local.described]
    assert None not in servers and len(set(servers)) == HOSTS
    for pid in servers:
        with open(f"/proc/{pid}/maps") as maps:
            assert "_XLAC" in maps.read()  # torch_xla imported
    outcome = on_cluster("import os\nos.getppid()", local)
    assert outcome.ok, text_view.render(outcome)
    assert outcome.results() == {o: servers[h] for o, h in outcome.hosts.items()}


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("rfc3987_syntax") is None,
                    reason="rfc3987_syntax is not installed: nothing to leave out")
def test_the_local_clusters_replicas_run_without_rfc3987_syntax(local):
    """What docs/clusters.md says: the local cluster's Ray processes, down to the replicas
    forked from its workers, find the stand-in first and never import the package."""
    outcome = on_cluster("""
        import sys, jsonschema._format
        ("rfc3987_syntax" in sys.modules, any(p.endswith("lean_imports") for p in sys.path))
        """, local)
    assert outcome.ok, text_view.render(outcome)
    assert outcome.results() == {o: (False, True) for o in range(HOSTS * PER_HOST)}


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_each_replica_gets_its_hosts_slice_and_no_inherited_skip_of_discovery(local):
    outcome = on_cluster("""
        import os
        {k: v for k, v in os.environ.items() if k.startswith(("MEGASCALE_", "SKIP_MEGA"))}
        """, local)
    assert outcome.ok, text_view.render(outcome)
    assert outcome.results() == {
        o: {"MEGASCALE_COORDINATOR_ADDRESS": local.hosts[0].address, "MEGASCALE_PORT": "8081",
            "MEGASCALE_NUM_SLICES": str(HOSTS), "MEGASCALE_SLICE_ID": str(o // PER_HOST)}
        for o in range(HOSTS * PER_HOST)}
    assert "2 slices (multislice)" in local.describe()


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_notebook_functions_and_classes_reach_every_host_and_come_back_as_the_notebooks(local):
    outcome = on_cluster("Point(scaled(index))", local, user_ns=NOTEBOOK)
    assert outcome.ok, text_view.render(outcome)
    assert {o: type(v) for o, v in outcome.results().items()} == {
        o: NOTEBOOK["Point"] for o in range(4)}
    assert {o: v.x for o, v in outcome.results().items()} == {0: 0, 1: 10, 2: 20, 3: 30}
    pulled = on_cluster("mine = [index] * 3", local, pull=("mine",), pull_from=3)
    assert pulled.pulled("mine") == {3: [3, 3, 3]}


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_names_a_host_cannot_load_fail_that_hosts_replicas_and_the_cluster_goes_on(local):
    outcome = on_cluster("scaled(index)", local, user_ns={"scaled": Unreachable()})
    assert [r.state for r in outcome.replicas.values()] == [FAILED] * 4
    assert outcome.replicas[3].error.evalue == (
        "the notebook names the cell uses could not be loaded on host 1 (ModuleNotFoundError: "
        "No module named 'test_cluster'). A module they need must be importable on every host "
        "(installed, or on sys.path); or define them in the cell.")
    assert local.up and on_cluster("index", local).ok


class Unreachable:
    """Pickled by reference to this test module, which the hosts cannot import."""


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_collectives_span_hosts_and_a_training_step_leaves_the_same_weights_everywhere(local):
    outcome = on_cluster("""
        import torch, torch_xla.core.xla_model as xm, torch_xla.runtime as xr
        t = torch.ones(2, device=device) * (index + 1)
        summed = xm.all_reduce(xm.REDUCE_SUM, t).cpu().tolist()
        xm.rendezvous("every host")
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.full((4, 3), float(index), device=device)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            xm.optimizer_step(opt)
        (summed, xr.world_size(), xr.global_ordinal(), model.weight.detach().cpu().tolist())
        """, local)
    assert outcome.ok, text_view.render(outcome)
    results = outcome.results()
    assert {tuple(r[0]) for r in results.values()} == {(10.0, 10.0)}  # 1 + 2 + 3 + 4
    assert [(r[1], r[2]) for _, r in sorted(results.items())] == [(4, i) for i in range(4)]
    weights = [r[3] for r in results.values()]
    assert all(w == weights[0] for w in weights), weights  # gradients averaged over hosts


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_failure_on_one_host_stops_every_host_and_names_the_replica(local):
    outcome = on_cluster("""
        import time
        if index == 2:
            raise ValueError("bad shard")
        time.sleep(120)
        """, local)
    assert outcome.replicas[2].state == FAILED
    assert outcome.replicas[2].error.evalue == "bad shard"
    assert [outcome.replicas[o].state for o in (0, 1, 3)] == [STOPPED] * 3
    assert "after replica 2 failed (ValueError)" in outcome.replicas[0].error.evalue
    assert outcome.elapsed < 60
    assert replicas_left(outcome) == []


class InterruptWhenAllStarted(RunObserver):
    """The notebook's Interrupt (SIGINT to this process) once every replica has started."""

    started_count = 0

    def started(self, outcome, ordinal):
        self.started_count += 1
        if self.started_count == HOSTS * PER_HOST:
            os.kill(os.getpid(), signal.SIGINT)


class InterruptWhenAllPrinted(RunObserver):
    """The notebook's Interrupt once every replica has printed ``line`` (a replica's start
    comes before its cell's first line runs: what the cell did before the line is done)."""

    def __init__(self, line: str):
        self.line, self.printed = line, set()

    def output(self, outcome, origin, lines):
        if self.line in lines and isinstance(origin, int) and origin not in self.printed:
            self.printed.add(origin)
            if len(self.printed) == HOSTS * PER_HOST:
                os.kill(os.getpid(), signal.SIGINT)


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.parametrize("runtime", ["torch_xla", pytest.param(
    "jax", marks=[needs_jax, pytest.mark.jax])])
def test_timeout_and_interrupt_stop_every_host_and_leave_no_replica(local, runtime):
    timed = on_cluster("import time\ntime.sleep(120)", local, timeout=3, runtime=runtime)
    assert [r.state for r in timed.replicas.values()] == [STOPPED] * 4
    assert "--timeout 3 s" in timed.replicas[3].error.evalue
    assert replicas_left(timed) == []

    outcome = on_cluster("import time\ntime.sleep(120)", local, runtime=runtime,
                         observer=InterruptWhenAllStarted())
    assert outcome.interrupted
    assert [r.state for r in outcome.replicas.values()] == [STOPPED] * 4
    assert outcome.replicas[1].error.ename == "KeyboardInterrupt"
    assert outcome.elapsed < 30
    pids = [r.pid for r in outcome.replicas.values()]
    assert None not in pids
    assert wait_until_gone([psutil.Process(p) for p in pids if psutil.pid_exists(p)],
                           timeout=0) == []
    assert on_cluster("index", local).ok  # the cluster goes on


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_an_interrupt_on_a_cluster_says_where_each_hosts_replicas_were(local):
    from test_where_stopped import AT_RENDEZVOUS, waiting

    stopped = on_cluster(waiting(3, 1000), local, observer=InterruptWhenAllPrinted("ready"))
    assert [r.state for r in stopped.replicas.values()] == [STOPPED] * 4
    said = str(XlaSpawnError(stopped))
    assert ("  host 0 · replica 0, host 0 · replica 1, host 1 · replica 2 "
            + AT_RENDEZVOUS) in said, said
    assert "  host 1 · replica 3 at line 5 in slow_load: `time.sleep(1000)`" in said, said


# -- warm replicas on every host (%xla_session while connected) --------------------------------

def ordinal_pids(session) -> dict:
    """{global ordinal: pid} of a cluster session's replicas."""
    return {h * PER_HOST + i: pid for h, replicas in session.replicas.items()
            for i, pid in replicas.items()}


@pytest.fixture
def warm(local):
    """Warm replicas on every host of the module's cluster, stopped after the test."""
    from colab_xla.notebook.targets.cluster_session import ClusterSession

    local.session = ClusterSession.start(local, announce=None)
    pids = ordinal_pids(local.session)
    yield local
    local.session.stop()
    local.session = None
    assert wait_until_gone([psutil.Process(p) for p in pids.values() if psutil.pid_exists(p)],
                           timeout=10) == []


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_session_keeps_every_hosts_replicas_and_their_globals_from_cell_to_cell(warm):
    pids = ordinal_pids(warm.session)
    assert sorted(pids) == [0, 1, 2, 3] and len(set(pids.values())) == 4
    first = on_cluster("import os\ncounter = index * 10\nos.getpid()", warm)
    assert first.ok, text_view.render(first)
    assert first.results() == pids  # the session's replicas ran it, by global ordinal
    second = on_cluster("""
        import torch, torch_xla.core.xla_model as xm
        counter += 1
        (counter, xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=device)).item())
        """, warm)
    assert second.ok, text_view.render(second)
    assert second.results() == {o: (o * 10 + 1, 4.0) for o in range(4)}  # and across hosts
    assert warm.session.cells_run == 2 and warm.session.up
    status = warm.session.describe()
    assert "4 replicas on 2 hosts, 2 cells run" in status
    assert f"replica 3: pid {pids[3]}" in status.split("host 1:")[1]


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_targets_on_a_cluster_session_run_the_chosen_replicas_of_each_host_only(warm):
    assert on_cluster("mark = index", warm).ok
    # Host 0 sits this one out; on host 1 only its replica 0 (global 2) runs it.
    chosen = on_cluster("mark = -1; (host, local_index)", warm, targets="1:0")
    assert chosen.ok and chosen.results() == {2: (1, 0)}, text_view.render(chosen)
    both = on_cluster("mark", warm, targets="0,3")  # by global ordinal
    assert both.results() == {0: 0, 3: 3}
    assert on_cluster("mark", warm).results() == {0: 0, 1: 1, 2: -1, 3: 3}
    from colab_xla.errors import OptionError
    with pytest.raises(OptionError, match=r"there is no replica 2:0 \(HOST:R"):
        on_cluster("1", warm, targets="2:0")


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_session_gets_a_notebook_name_once_and_again_when_the_notebook_changes_it(warm):
    user_ns = {**NOTEBOOK, "seen": [1]}
    grown = on_cluster("seen.append(index)\n(len(seen), Point(scaled(index)))", warm,
                       user_ns=user_ns)
    assert grown.ok, text_view.render(grown)
    assert {o: (n, type(p), p.x) for o, (n, p) in grown.results().items()} == {
        o: (2, NOTEBOOK["Point"], o * 10) for o in range(4)}
    kept = on_cluster("len(seen)", warm, user_ns=user_ns)  # not sent again: theirs stays
    assert kept.results() == {o: 2 for o in range(4)}
    user_ns["seen"] = [5, 6, 7]  # the notebook gave it a new value: sent to every host
    assert on_cluster("len(seen)", warm, user_ns=user_ns).results() == {o: 3 for o in range(4)}


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_an_interrupted_session_cell_keeps_the_session_and_a_dead_replica_ends_it_everywhere(
        warm):
    pids = ordinal_pids(warm.session)

    stopped = on_cluster("kept = index\nprint('kept')\nimport time\ntime.sleep(120)", warm,
                         observer=InterruptWhenAllPrinted("kept"))
    assert stopped.interrupted and stopped.session_ended is None
    assert [r.state for r in stopped.replicas.values()] == [STOPPED] * 4
    after = on_cluster("import os\n(kept, os.getpid())", warm)
    assert after.results() == {o: (o, pids[o]) for o in range(4)}  # same processes, globals

    died = on_cluster("import os, time\nif index == 3:\n    os._exit(3)\ntime.sleep(120)", warm)
    assert died.replicas[3].state == FAILED
    assert died.session_ended == "on host 1, replica 3 died (exit code 3)"
    assert not warm.session.up and warm.up  # the session ended; the cluster goes on
    assert wait_until_gone([psutil.Process(p) for p in pids.values() if psutil.pid_exists(p)],
                           timeout=10) == []
    fresh = on_cluster("import os\nos.getpid()", warm)  # one-off replicas again
    assert fresh.ok and not set(fresh.results().values()) & set(pids.values())


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_session_magic_on_a_cluster_starts_shows_and_stops_every_hosts_replicas(
        local, capsys):
    shell = get_ipython()
    shell.run_line_magic("load_ext", "colab_xla")
    shell.run_line_magic("xla_session", "")
    assert "none (%xla_session start starts one on every host)" in capsys.readouterr().out
    with pytest.raises(UsageError, match="-n: on a cluster, each host's replicas are the "
                                         "ones %xla_cluster planned"):
        shell.run_line_magic("xla_session", "start -n 2")
    try:
        shell.run_line_magic("xla_session", "start")
        out = capsys.readouterr().out
        assert "colab_xla session: 4 replicas started on 2 hosts" in out
        assert "host 0:" in out and "host 1:" in out
        pids = ordinal_pids(local.session)
        with pytest.raises(UsageError, match="a session is up on the cluster"):
            shell.run_line_magic("xla_session", "start")
        shell.run_cell_magic("xla_spawn", "--no-widget -o got", "import os\nos.getpid()")
        assert shell.user_ns["got"] == pids
        # Auto mode on the cluster's session: a plain cell runs on every host's replicas.
        shell.run_line_magic("xla_session", "auto")
        assert shell.run_cell("where = (host, index)").success
        shell.run_line_magic("xla_session", "auto off")
        shell.run_cell_magic("xla_spawn", "--no-widget -o got", "where")
        assert shell.user_ns["got"] == {o: (o // 2, o) for o in range(4)}
        shell.run_line_magic("xla_doctor", "")
        assert (f"connected to {local.address}: 2 hosts, 4 replicas, CPU hosts; a session is "
                "up on every host") in capsys.readouterr().out
    finally:
        shell.run_line_magic("xla_session", "stop")
    assert "colab_xla session: stopped." in capsys.readouterr().out
    assert local.session is None and local.up
    assert wait_until_gone([psutil.Process(p) for p in pids.values() if psutil.pid_exists(p)],
                           timeout=10) == []


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_remote_hosts_unended_line_shows_while_it_grows_and_once_when_it_ends(local, tmp_path):
    seen = tmp_path / "seen"

    class WatchReplica3(RunObserver):
        shown = None

        def tick(self, outcome):
            partial = outcome.replicas[3].log.partial()
            if partial and self.shown is None:
                self.shown = partial
                seen.touch()  # the cell goes on once the notebook has shown it

    watch = WatchReplica3()
    outcome = on_cluster(f"""
        import os, time
        print("loading 50%", end="", flush=True)
        while not os.path.exists({str(seen)!r}):
            time.sleep(0.02)
        print(" 100%")
        """, local, observer=watch, timeout=60)
    assert outcome.ok, text_view.render(outcome)
    assert watch.shown == [("stdout", "loading 50%")]
    assert outcome.replicas[3].text == "loading 50% 100%"  # shown once, not twice
    assert outcome.replicas[3].log.partial() == []


# -- JAX processes on every host (%%xla_spawn --runtime jax while connected) -----------------

def on_jax_cluster(test):
    """A test of JAX processes on this module's local cluster (it needs Ray and jax)."""
    for mark in (pytest.mark.timeout(300), pytest.mark.jax, pytest.mark.cluster, needs_jax,
                 needs_ray):
        test = mark(test)
    return test


@on_jax_cluster
def test_jax_processes_of_every_host_are_one_job_with_global_devices_and_collectives(local):
    import numpy as np

    outcome = on_cluster("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()), ("d",))
        x = multihost_utils.host_local_array_to_global_array(
            np.array([index + 1.0], dtype=np.float32), mesh, P("d"))
        summed = jax.jit(lambda a: a.sum())(x)
        gathered = multihost_utils.process_allgather(np.array([index]))
        mine = jnp.arange(3) * index
        print("process", jax.process_index(), "of", jax.process_count())
        import os, psutil
        listening = {c.laddr.ip.removeprefix("::ffff:")  # (gRPC's: IPv4 in IPv6)
                     for c in psutil.Process().net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        (jax.process_index(), jax.process_count(), [d.process_index for d in jax.devices()], host,
         local_index, float(summed), gathered.ravel().tolist(), mine,
         (os.environ["COLAB_XLA_CLUSTER_ADDRESS"], sorted(listening)))
        """, local, runtime="jax", pull=("mine",), pull_from=3)
    assert outcome.ok, text_view.render(outcome)
    results = outcome.results()
    # The coordinator (process 0's) and gloo's listen on the host's address, not [::].
    assert {o: r[8][1] for o, r in results.items()} == {
        o: [r[8][0]] for o, r in results.items()}
    assert {o: r[:7] for o, r in results.items()} == {
        h * PER_HOST + i: (h * PER_HOST + i, 4, [0, 1, 2, 3], h, i, 10.0, [0, 1, 2, 3])
        for h in range(HOSTS) for i in range(PER_HOST)}
    assert {o: (type(r[7]), r[7].tolist()) for o, r in results.items()} == {
        o: (np.ndarray, [0, o, 2 * o]) for o in range(4)}  # NumPy, by global ordinal
    assert outcome.replicas[3].text == "process 3 of 4"
    assert list(outcome.pulled("mine")) == [3] and outcome.pulled("mine")[3].tolist() == [0, 3, 6]
    assert outcome.hosts == {0: 0, 1: 0, 2: 1, 3: 1}


@on_jax_cluster
def test_a_jax_process_failing_on_one_host_stops_every_host_waiting_in_a_collective(local):
    outcome = on_cluster("""
        import numpy as np
        from jax.experimental import multihost_utils
        if index == 2:
            raise ValueError("bad shard")
        multihost_utils.process_allgather(np.ones(1))
        """, local, runtime="jax")
    assert outcome.replicas[2].state == FAILED
    assert outcome.replicas[2].error.evalue == "bad shard"
    assert "Cell In[3], line 5" in outcome.replicas[2].error.traceback  # (1: %%xla_spawn)
    assert {outcome.replicas[o].state for o in (0, 1, 3)} <= {FAILED, STOPPED}
    assert outcome.elapsed < 60
    assert replicas_left(outcome) == []
    assert on_cluster("index", local).ok  # the cluster goes on


@on_jax_cluster
def test_the_magic_runs_jax_cells_and_a_jax_session_on_the_cluster(local, capsys):
    shell = get_ipython()
    shell.run_line_magic("load_ext", "colab_xla")
    shell.run_cell_magic("xla_spawn", "--runtime jax --devices-per-process 2 --no-widget -o got",
                         "import jax\n(jax.process_count(), len(jax.devices()), "
                         "len(jax.local_devices()))")
    assert shell.user_ns["got"] == {o: (4, 8, 2) for o in range(4)}
    try:
        shell.run_line_magic("xla_session", "start --runtime jax")
        assert "4 replicas (JAX processes) on 2 hosts" in capsys.readouterr().out
        pids = ordinal_pids(local.session)
        shell.run_cell_magic("xla_spawn", "--no-widget", "import jax, os\nkept = os.getpid()")
        shell.run_cell_magic("xla_spawn", "--no-widget -o again",
                             "(kept, jax.process_index(), jax.process_count())")
        assert shell.user_ns["again"] == {o: (pid, o, 4) for o, pid in pids.items()}
        with pytest.raises(UsageError, match="--runtime: the session's replicas on the "
                                             "cluster were started with their own options"):
            shell.run_cell_magic("xla_spawn", "--runtime torch_xla", "1")
    finally:
        shell.run_line_magic("xla_session", "stop")
    assert wait_until_gone([psutil.Process(p) for p in pids.values() if psutil.pid_exists(p)],
                           timeout=10) == []


# -- torch.distributed processes on every host (%%xla_spawn --runtime torch) ----------------

@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_torch_processes_of_every_host_are_one_job_with_global_ranks(local):
    outcome = on_cluster("""
        import os, torch, torch.distributed as dist
        t = torch.tensor([float(index + 1)])
        dist.all_reduce(t)
        (dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"],
         os.environ["NODE_RANK"], os.environ["MASTER_ADDR"], t.item())
        """, local, runtime="torch")
    assert outcome.ok, text_view.render(outcome)
    results = outcome.results()
    masters = {r[4] for r in results.values()}
    assert len(masters) == 1  # host 0's
    assert {o: r[:4] + r[5:] for o, r in results.items()} == {
        h * PER_HOST + i: (h * PER_HOST + i, HOSTS * PER_HOST, str(i), str(h), 10.0)
        for h in range(HOSTS) for i in range(PER_HOST)}
    assert on_cluster("index", local).ok  # the cluster goes on


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_stores_hosts_meet_at_listen_on_host_0s_address_alone_their_keys_under_a_secret(
        local):
    # A TCP store has no authentication, and torch's own listens on every interface.
    from _listeners import LISTENING

    host0 = local.described[0]
    where, _, secret = host0["store"].partition("/")  # (the CPU simulation's: the agent's)
    port = int(where.rpartition(":")[2])
    agent = [(c.laddr.ip, c.laddr.port) for c in
             psutil.Process(host0["pid"]).net_connections("tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert agent == [(host0["address"], port)] and len(secret) == 32, (agent, secret)
    outcome = on_cluster(LISTENING + textwrap.dedent("""
        import os, torch, torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), _listening(),
         "COLAB_XLA_TORCH_STORE_SECRET" in os.environ, t.item())
        """), local, runtime="torch")
    assert outcome.ok, text_view.render(outcome)
    (address, master_port, listening, secret_left, total) = outcome.results()[0]
    assert [a for a in listening if a[1] == master_port] == [(address, master_port)], listening
    assert (address, secret_left, total) == (host0["address"], False, HOSTS * PER_HOST)


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_stall_on_a_cluster_says_where_every_hosts_replicas_are(local):
    from test_where_stopped import RENDEZVOUS_LINE, Notices, waiting

    notices = Notices()
    outcome = on_cluster(waiting(3, 6, then="print('after', flush=True)\n"), local,
                         observer=notices, stall=1)
    assert outcome.ok, text_view.render(outcome)
    said = [n for kind, n in notices.seen if kind == "notice" and n]
    assert any("host 1 · replica 3 at line 5 in slow_load: `time.sleep(6)`" in n
               for n in said), said
    rendezvous = f"at line {RENDEZVOUS_LINE}: `xm.rendezvous('ready')`"
    assert any("host 0 · replica 0" in n and rendezvous in n
               for n in said), said
    assert notices.seen[-1] != ("notice", said[-1])  # it went when output came again


@needs_ray
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_xla_debug_on_a_cluster_session_runs_pdb_on_the_replicas_host(warm):
    from test_debug import FAILS, Person

    failed = on_cluster(FAILS, warm)
    assert failed.failed == [1, 2], text_view.render(failed)
    person = Person("p secret", "p index", "q")
    assert warm.session.debug(None, ask=person.ask, show=person.show) == "ended"
    assert "(Pdb) p secret\n42\n(Pdb) p index\n1\n" in person.text, person.text
    other = Person("p secret", "q")  # host 1's first replica (global 2), by host:replica
    assert warm.session.debug((1, 0), ask=other.ask, show=other.show) == "ended"
    assert "(Pdb) p secret\n43\n" in other.text, other.text
    assert on_cluster("kept", warm).results() == {0: 0, 1: 10, 2: 20, 3: 30}
