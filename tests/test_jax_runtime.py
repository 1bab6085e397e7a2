"""``--runtime jax``: JAX processes with jax.distributed initialized before the cell
(units, then real processes on CPU through ``run_cell`` and the magic)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from IPython.core.error import UsageError

from colab_xla.notebook import doctor
from colab_xla.runtimes import jax as jax_runtime
from colab_xla.errors import OptionError
from colab_xla.runtimes.plan import Hardware, ReplicaCountError
from colab_xla.notebook.launch import Launch
from colab_xla.notebook.outcome import FAILED, STOPPED, RunObserver
from colab_xla.notebook.views import text as text_view

from _kernel import replicas_left, wait_until_gone  # tests/ is on sys.path
from _shell import get_ipython

needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                               reason="jax is not installed in this stack")
JAX = Launch(runtime="jax")


# -- units ----------------------------------------------------------------------------------

def test_jax_processes_on_cpu_get_one_device_each_unless_asked_and_keep_other_xla_flags():
    cpu = Hardware(pjrt_device="CPU")
    plan = jax_runtime.plan(None, cpu, None, {})
    assert (plan.device_type, plan.replicas, plan.processes) == ("CPU", 2, 2)
    assert plan.runtime is jax_runtime.RUNTIME and plan == jax_runtime.RUNTIME.plan(None, cpu)
    assert plan.own_processes  # never xmp.spawn's
    assert plan.env == {"COLAB_XLA_RUNTIME": "jax", "JAX_PLATFORMS": "cpu",
                        "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    four = jax_runtime.plan(3, cpu, 4, {"XLA_FLAGS": "--xla_dump_to=/tmp/d "
                                                     "--xla_force_host_platform_device_count=8"})
    assert four.replicas == 3 and four.env["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4")
    assert "3 processes on CPU with 4 devices each" in four.note
    assert four == jax_runtime.RUNTIME.plan(3, cpu, devices_per_process=4, environ={
        "XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8"})


def test_jax_counts_that_cannot_work_are_refused_with_what_to_do():
    cpu = Hardware(pjrt_device="CPU")
    with pytest.raises(ReplicaCountError, match="-n 0: the number of JAX processes"):
        jax_runtime.plan(0, cpu, None, {})
    with pytest.raises(ReplicaCountError, match="at most 16 JAX processes.*--devices-per-process"):
        jax_runtime.plan(17, cpu, None, {})
    with pytest.raises(ReplicaCountError, match="--devices-per-process 0: give 1 or more"):
        jax_runtime.plan(2, cpu, 0, {})
    tpu = Hardware(pjrt_device="TPU", tpu_chips=4, tpu_cores_per_chip=1)
    assert jax_runtime.plan(None, tpu, None, {}).replicas == 1  # one process drives the chips
    with pytest.raises(ReplicaCountError, match="one process driving every chip"):
        jax_runtime.plan(4, tpu, None, {})


def test_launch_options_that_belong_to_the_other_runtime_are_refused():
    with pytest.raises(OptionError, match="--runtime tensorflow: use torch_xla"):
        Launch(runtime="tensorflow")
    with pytest.raises(OptionError, match="--launcher and --debug-single are torch_xla's"):
        Launch(runtime="jax", launcher="launch")
    with pytest.raises(OptionError, match="--devices-per-process is for --runtime jax"):
        Launch(devices_per_process=2)
    assert JAX.describe() == "fork, JAX processes (jax.distributed)"


def test_the_call_that_started_a_jax_backend_in_the_notebook_is_named():
    history = ["", "import jax", "x = jnp.ones(3)", "%%xla_spawn --runtime jax\njnp.ones(2)"]
    assert doctor.likely_cause(history, jax_runtime.RUNTIME) == "In[2] calls `jnp.ones(`"
    assert doctor.likely_cause(history) is None  # not a torch_xla call


@needs_jax
@pytest.mark.timeout(120)
def test_the_guard_sees_a_jax_backend_only_once_one_started():
    probe = textwrap.dedent("""
        import jax
        from colab_xla.runtimes import jax as jax_runtime
        print(jax_runtime.backend_problem(), jax_runtime.RUNTIME.problems())
        jax.numpy.ones(2)
        print(jax_runtime.backend_problem().code,
              [p.code for p in jax_runtime.RUNTIME.problems()] == [jax_runtime.BACKEND_STARTED])
        """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=100, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.split() == ["None", "[]", "jax-backend-initialized", "True"], out.stderr


@needs_jax
def test_the_coordinator_listens_where_the_processes_are_told_unless_jax_is_told_otherwise(
        monkeypatch):
    # JAX's default is every interface ([::]:port); a user's JAX_COORDINATOR_BIND_ADDRESS
    # is JAX's own (None leaves it to JAX, which reads it).
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax_runtime, "gloo_listens_on", lambda address: calls.append(address))
    monkeypatch.delenv(jax_runtime.BIND_VARIABLE, raising=False)
    for membership in (("10.0.0.2:1234", 4, 0, "10.0.0.2"), ("unix:/r/c", 2, 1, "127.0.0.1")):
        monkeypatch.setattr(jax_runtime, "_initialized", False)
        monkeypatch.setattr(jax_runtime, "_membership", membership)
        jax_runtime.initialize()
        jax_runtime.initialize()  # (once)
    assert [(c["coordinator_address"], c["coordinator_bind_address"], c["process_id"])
            for c in calls[::2]] == [("10.0.0.2:1234", "10.0.0.2:1234", 0),
                                      ("unix:/r/c", "unix:/r/c", 1)]
    assert calls[1::2] == ["10.0.0.2", "127.0.0.1"]  # where gloo listens
    monkeypatch.setenv(jax_runtime.BIND_VARIABLE, "[::]:1234")
    monkeypatch.setattr(jax_runtime, "_initialized", False)
    jax_runtime.initialize()
    assert calls[-2]["coordinator_bind_address"] is None


# -- real JAX processes ---------------------------------------------------------------------

def run_jax(source: str, **kw):
    from colab_xla.notebook.targets import run_cell

    return run_cell(textwrap.dedent(source).lstrip("\n"), launch=kw.pop("launch", JAX),
                    announce=None, label="Cell In[4]", **kw)


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_every_process_has_jax_distributed_with_global_devices_and_collectives():
    outcome = run_jax("""
        import jax, numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()), ("d",))
        local = np.arange(len(jax.local_devices()), dtype=np.float32) + 10 * index
        x = multihost_utils.host_local_array_to_global_array(local, mesh, P("d"))
        summed = jax.jit(lambda a: a.sum())(x)
        gathered = multihost_utils.process_allgather(np.array([index]))
        print("process", jax.process_index(), "of", jax.process_count())
        (jax.process_index(), jax.process_count(), len(jax.devices()),
         [d.id for d in jax.local_devices()] == [device.id, device.id + 1],
         summed, gathered.ravel().tolist())
        """, replicas=3, launch=Launch(runtime="jax", devices_per_process=2))
    assert outcome.ok, text_view.render(outcome)
    expected_sum = sum(i * 10 * 2 + 1 for i in range(3))  # 2 devices each: 10i and 10i + 1
    assert {o: (r[0], r[1], r[2], r[3], float(r[4]), r[5])
            for o, r in outcome.results().items()} == {
        o: (o, 3, 6, True, float(expected_sum), [0, 1, 2]) for o in range(3)}
    assert outcome.replicas[2].text == "process 2 of 3"


# What listens in a one-host run: each process lists its own sockets once gloo's pairs are
# made (a collective): the addresses of its TCP listeners and the paths of its Unix sockets,
# with the coordinator and, if it is a Unix socket, its directory's mode and owner.
LISTENERS = """
    import os, psutil, numpy as np
    from jax.experimental import multihost_utils
    multihost_utils.process_allgather(np.array([index]))
    me = psutil.Process()
    coordinator = os.environ["COLAB_XLA_JAX_COORDINATOR"]
    where = os.path.dirname(coordinator[5:]) if coordinator.startswith("unix:") else None
    info = where and os.stat(where)
    (coordinator, where, info and oct(info.st_mode & 0o777), info and info.st_uid,
     sorted({c.laddr.ip for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN}),
     sorted({c.laddr for c in me.net_connections("unix") if c.laddr}))
    """


def loopback(ip: str) -> bool:
    import ipaddress

    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def short_state_dir(monkeypatch, directory: str) -> None:
    """colab_xla's state directory (so a run's work directory) under ``directory``."""
    import tempfile

    from colab_xla.notebook import state

    monkeypatch.setattr(tempfile, "tempdir", directory)
    monkeypatch.setattr(state, "_state_dir", None)


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
@pytest.mark.parametrize("place", ["a short path", "a path too long for a socket"])
def test_the_coordinator_is_a_socket_only_its_user_reaches_and_nothing_listens_beyond_loopback(
        place, monkeypatch):
    # JAX's coordination service authenticates no one: in the run's private directory (or,
    # where that path would be too long for a Unix socket, on 127.0.0.1: never [::]).
    import tempfile

    from colab_xla.notebook import state

    top = tempfile.mkdtemp(prefix="cxj-", dir="/tmp")  # (pytest's tmp_path may be long)
    try:
        if place == "a path too long for a socket":
            top = os.path.join(top, "d" * 60)
            os.mkdir(top, 0o700)
        short_state_dir(monkeypatch, top)
        work = state.own_dir("work")
        outcome = run_jax(LISTENERS, replicas=2)
    finally:
        import shutil

        shutil.rmtree(top if place == "a short path" else os.path.dirname(top),
                      ignore_errors=True)
    assert outcome.ok, text_view.render(outcome)
    (coordinator, where, mode, owner, _, unix), (again, *_) = (
        outcome.results()[o] for o in (0, 1))
    assert again == coordinator
    if place == "a short path":
        assert coordinator.startswith("unix:"), coordinator
        path = os.path.join(where, jax_runtime.SOCKET_NAME)
        assert coordinator == f"unix:{path}" and path in unix  # process 0 serves it there
        assert os.path.dirname(where) == work and os.path.basename(where).startswith("run-")
        assert (mode, owner) == ("0o700", os.getuid())
    else:
        assert coordinator.startswith("127.0.0.1:") and where is None
    for ordinal, (*_, tcp, _) in outcome.results().items():
        assert tcp and all(loopback(ip) for ip in tcp), (ordinal, tcp)  # (gloo's at least)


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_gloo_listens_on_loopback_where_the_hostname_is_the_machines_network_address():
    # gloo binds the address the hostname resolves to (a cloud VM's: its network address)
    # unless told one: a run in a UTS namespace whose hostname is this machine's address.
    import socket
    import shutil
    import tempfile

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a hostname of its own")
    mine = [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
            if a.family == socket.AF_INET and not loopback(a.address)]
    if not mine:
        pytest.skip("this machine has no address but loopback")
    script = textwrap.dedent(f"""
        import json, textwrap
        from colab_xla.notebook.targets import run_cell
        from colab_xla.notebook.launch import Launch
        from colab_xla.notebook.views import text
        outcome = run_cell(textwrap.dedent({LISTENERS!r}), launch=Launch(runtime="jax"),
                           replicas=2, announce=None)
        print(json.dumps({{o: r[4] for o, r in outcome.results().items()}})
              if outcome.ok else text.render(outcome))
        """)
    top = tempfile.mkdtemp(prefix="cxj-", dir="/tmp")
    try:
        done = subprocess.run(
            ["unshare", "--uts", "--", "sh", "-c", f"hostname {mine[0]} && exec \"$0\" -c \"$1\"",
             sys.executable, script], capture_output=True, text=True, timeout=240,
            env={**os.environ, "TMPDIR": top})
    finally:
        shutil.rmtree(top, ignore_errors=True)
    import json

    assert done.returncode == 0, done.stderr[-3000:]
    listeners = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(listeners) == ["0", "1"], done.stdout
    for ordinal, tcp in listeners.items():
        assert tcp and all(loopback(ip) for ip in tcp), (ordinal, tcp, mine[0])


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_a_forked_jax_process_never_collects_the_notebooks_objects(monkeypatch):
    # Its backend's start ran a full collection over every object inherited from the
    # notebook, copying the shared heap: 1.3 s a process on 2 cores (bench/jax_runtime.py).
    import gc

    freezes = []  # who called gc.freeze: a forked process appends to its own copy only
    freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(os.getpid()) or freeze())
    outcome = run_jax("import gc, jax\n(jax.process_index(), gc.get_freeze_count())",
                      replicas=2)
    assert outcome.ok, text_view.render(outcome)
    frozen = {o: r[1] for o, r in outcome.results().items()}
    assert all(count > 1000 for count in frozen.values()), frozen
    assert gc.get_freeze_count() == 0  # the notebook's own collector still sees them
    # ... and the notebook never froze them, even for a moment: frozen while it forked,
    # its young garbage went to its oldest generation at every run (a kernel grew ~130 KB
    # a run).
    assert freezes == []


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_values_arrive_as_numpy_and_a_global_array_is_refused_with_the_gather_to_use():
    import numpy as np

    outcome = run_jax("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh, PartitionSpec as P
        mine = {"local": jnp.arange(3) * index, "both": [jnp.ones(2), 7]}
        mine
        """, replicas=2, pull=("mine",), pull_from=1)
    assert outcome.ok, text_view.render(outcome)
    value = outcome.results()[1]
    assert type(value["local"]) is np.ndarray and value["local"].tolist() == [0, 1, 2]
    assert type(value["both"][0]) is np.ndarray and value["both"][1] == 7
    assert outcome.pulled("mine")[1]["local"].tolist() == [0, 1, 2]

    refused = run_jax("""
        import jax, numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()), ("d",))
        multihost_utils.host_local_array_to_global_array(np.ones(1), mesh, P("d"))
        """, replicas=2)
    assert [r.state for r in refused.replicas.values()] == [FAILED, FAILED]
    message = refused.replicas[0].error.evalue
    assert "a global jax.Array of shape (2,) that this process does not hold whole" in message
    assert "multihost_utils.process_allgather(x)" in message


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_a_process_that_ends_first_waits_for_the_others_instead_of_ending_them(tmp_path):
    # Process 0 serves jax.distributed's coordination: had it ended with its cell, process
    # 1 would die of "JAX distributed service detected fatal errors" (within a heartbeat)
    # while it still runs its cell.
    go = tmp_path / "go"

    class ReleaseAfterAHeartbeat(RunObserver):
        def finished(self, outcome, ordinal):
            if ordinal == 0:  # process 1 goes on for longer than JAX takes to notice
                import threading

                threading.Timer(jax_runtime.HEARTBEAT_TIMEOUT + 2, go.touch).start()

    outcome = run_jax(f"""
        import os, time
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("started")
        while index == 1 and not os.path.exists({str(go)!r}):
            time.sleep(0.05)
        index
        """, replicas=2, observer=ReleaseAfterAHeartbeat())
    assert outcome.ok, text_view.render(outcome)
    assert outcome.results() == {0: 0, 1: 1}
    assert outcome.replicas[1].elapsed > jax_runtime.HEARTBEAT_TIMEOUT


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_one_process_failing_stops_the_ones_waiting_for_it_in_a_collective():
    outcome = run_jax("""
        import numpy as np
        from jax.experimental import multihost_utils
        if index == 1:
            raise ValueError("bad batch")
        multihost_utils.process_allgather(np.ones(1))
        """, replicas=3)
    assert outcome.replicas[1].error.evalue == "bad batch"
    assert outcome.replicas[1].error.traceback.startswith("Traceback")
    assert "Cell In[4], line 5" in outcome.replicas[1].error.traceback  # (line 1: %%xla_spawn)
    assert {outcome.replicas[o].state for o in (0, 2)} <= {FAILED, STOPPED}
    assert outcome.elapsed < 60
    assert replicas_left(outcome) == []


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_interrupt_and_timeout_stop_every_jax_process():
    timed = run_jax("import time\ntime.sleep(120)", replicas=2, timeout=3)
    assert [r.state for r in timed.replicas.values()] == [STOPPED, STOPPED]

    class InterruptWhenAllStarted(RunObserver):
        count = 0

        def started(self, outcome, ordinal):
            self.count += 1
            if self.count == 2:
                os.kill(os.getpid(), signal.SIGINT)

    outcome = run_jax("import time\ntime.sleep(120)", replicas=2,
                      observer=InterruptWhenAllStarted())
    assert outcome.interrupted and outcome.elapsed < 30
    assert [r.state for r in outcome.replicas.values()] == [STOPPED, STOPPED]
    assert replicas_left(outcome) == []


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_the_magic_runs_jax_processes_and_a_jax_session_keeps_them(capsys):
    shell = get_ipython()
    shell.run_line_magic("load_ext", "colab_xla")
    with pytest.raises(UsageError, match="--devices-per-process is for --runtime jax"):
        shell.run_cell_magic("xla_spawn", "--devices-per-process 2", "1")
    shell.run_cell_magic("xla_spawn", "--runtime jax -n 2 --no-widget -o got",
                         "import jax\njax.process_index() * 10")
    assert shell.user_ns["got"] == {0: 0, 1: 10}
    try:
        shell.run_line_magic("xla_session", "start --runtime jax -n 2")
        from colab_xla.notebook import targets

        pids = {i: r.pid for i, r in targets.local_session().replicas.items()}
        shell.run_cell_magic("xla_spawn", "--no-widget", "import jax, os\nkept = os.getpid()")
        shell.run_cell_magic("xla_spawn", "--no-widget -o again",
                             "(kept, jax.process_count())")
        assert shell.user_ns["again"] == {i: (pid, 2) for i, pid in pids.items()}
        with pytest.raises(UsageError, match="--runtime: this session's replicas were "
                                             "started with their own options"):
            shell.run_cell_magic("xla_spawn", "--runtime torch_xla", "1")
    finally:
        shell.run_line_magic("xla_session", "stop")
    assert wait_until_gone([psutil.Process(p) for p in pids.values() if psutil.pid_exists(p)],
                           timeout=10) == []


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_a_jax_backend_started_in_the_notebook_refuses_the_run_naming_the_cell():
    probe = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from IPython.core.error import UsageError
        from IPython.testing.globalipapp import start_ipython
        ip = start_ipython()
        ip.run_line_magic("load_ext", "colab_xla")
        ip.user_ns["In"] = ["", "import jax", "x = jnp.ones(3)"]
        jnp.ones(3)
        try:
            ip.run_cell_magic("xla_spawn", "--runtime jax --no-widget", "1")
        except UsageError as exc:
            print(exc)
        """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=200, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert "JAX has started a backend in this notebook's own process" in out.stdout, out.stderr
    assert "Likely: In[2] calls `jnp.ones(`." in out.stdout


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_torchax_works_on_the_processes_and_its_tensors_arrive_as_cpu_tensors():
    pytest.importorskip("torchax")
    import torch

    outcome = run_jax("""
        import jax, torch, torchax
        with torchax.default_env():
            t = torch.ones(2, device="jax") * (index + 1)
        (type(t).__name__, jax.process_count(), t)
        """, replicas=2)
    assert outcome.ok, text_view.render(outcome)
    results = outcome.results()
    assert [(r[0], r[1]) for r in results.values()] == [("Tensor", 2)] * 2
    assert all(type(r[2]) is torch.Tensor for r in results.values())
    assert [r[2].tolist() for r in results.values()] == [[1.0, 1.0], [2.0, 2.0]]


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_a_timeout_says_where_each_jax_process_was():
    # Process 1 took another branch; process 0 waits for it in a collective, in native code.
    outcome = run_jax("""
        import time
        from jax.experimental import multihost_utils
        if index == 1:
            time.sleep(1000)
        multihost_utils.sync_global_devices('ready')
        """, replicas=2, timeout=10)  # (every process at its place, on a loaded machine)
    assert [r.state for r in outcome.replicas.values()] == [STOPPED, STOPPED]
    assert outcome.replicas[1].error.place == "line 5: `time.sleep(1000)`"
    place = outcome.replicas[0].error.place
    assert place.startswith("line 6: `multihost_utils.sync_global_devices('ready')` (in "), place
