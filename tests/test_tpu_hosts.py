"""TPU hosts without a TPU: each host of tests/tpu_hosts/*.json (environment, PCI bus and
metadata server, with their public sources) replayed against torch_xla's own code.

Only the lowest level is faked: the sysfs glob (``glob.glob`` of /sys/bus/pci/devices, which
then reads real files of a tree in tmp_path) and the metadata server's HTTP fetch
(``requests.get``). Everything else -- colab_xla's plan, torch_xla's PCI scan, its
``num_local_processes`` and ``configure_topology`` -- is the installed code, so the same
tests check torch_xla 2.9 and 2.8.
"""

import functools
import glob
import json
import operator
import os
import threading
from pathlib import Path

import pytest

from colab_xla.notebook import hardware, preflight, tpu_scan
from colab_xla.notebook.torch_xla_import import import_torch_xla
from colab_xla.runtimes import torch_xla as torch_xla_runtime
from colab_xla.runtimes.plan import ReplicaCountError
from colab_xla.runtimes.torch_xla import UnsupportedTpuError, plan_replicas
from colab_xla.notebook.launch import replica_environ
from colab_xla.wire.cell import Cell

requests = pytest.importorskip("requests")  # (torch_xla's dependency: not in every stack)

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]

HOSTS = {p.stem: json.loads(p.read_text())
         for p in sorted((Path(__file__).parent / "tpu_hosts").glob("*.json"))}
_PCI = "/sys/bus/pci/devices"
_REAL_GLOB = glob.glob
# What a replica process's topology is made of (torch_xla.core.xla_env_vars).
_PER_PROCESS = ("TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS",
                "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID",
                "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT")


@pytest.fixture(scope="module")
def tpu():
    import_torch_xla()
    from torch_xla._internal import tpu
    return tpu


class FakeMetadata:
    """The GCE metadata server: answers from a fixture, is unreachable (None), or never
    answers ("never answers": it waits until the test ends)."""

    def __init__(self, answers):
        self.answers, self.asked, self.release = answers, threading.Event(), threading.Event()

    def get(self, url, *args, **kwargs):
        self.asked.set()
        if self.answers == "never answers":
            self.release.wait()
        if not isinstance(self.answers, dict):
            raise requests.ConnectionError(f"fake metadata server: {url} unreachable")
        key = url.rstrip("/").rsplit("/", 1)[-1]
        response = requests.Response()
        response.url = url
        response.status_code = 200 if key in self.answers else 404
        response._content = self.answers.get(key, "").encode()
        return response


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """``fake_host(host)``: this machine's PCI bus, metadata server and TPU environment
    become the host's; returns the metadata fake."""
    fakes = []

    def make(host, *, pci=None):
        pci = pci or host["pci"]
        root = tmp_path / "pci"
        devices = [("0x8086", "0x1237")] + [("0x1ae0", pci["device"])] * pci["count"]
        for i, (vendor, device) in enumerate(devices):  # with one device that is no TPU
            d = root / f"0000:00:{i + 4:02x}.0"
            d.mkdir(parents=True)
            (d / "vendor").write_text(vendor + "\n")
            (d / "device").write_text(device + "\n")

        def fake_glob(pattern, *args, **kwargs):
            if pattern.startswith(_PCI):
                pattern = str(root) + pattern[len(_PCI):]
            return _REAL_GLOB(pattern, *args, **kwargs)

        monkeypatch.setattr(glob, "glob", fake_glob)
        metadata = FakeMetadata(host["metadata"])
        fakes.append(metadata)
        monkeypatch.setattr(requests, "get", metadata.get)
        for key in list(os.environ):
            if key.startswith(("TPU_", "PJRT_", "CLOUD_TPU_", "XLA_", "CPU_NUM_DEVICES")):
                monkeypatch.delenv(key)
        for key, value in host["environ"].items():
            monkeypatch.setenv(key, value)
        tpu_scan.tpu_chips.cache_clear()
        return metadata

    yield make
    for metadata in fakes:
        metadata.release.set()  # a thread still waiting on it ends
    tpu_scan.tpu_chips.cache_clear()


def _mesh(bounds: str):
    return [int(d) for d in bounds.split(",")]


def _size(dims):
    return functools.reduce(operator.mul, dims, 1)


def replay(tpu, parent_env, *, chips):
    """The environment of each process xmp.spawn(nprocs=None) starts, as torch_xla makes
    it: run_multiprocess counts processes in the launching process
    (tpu.num_local_processes), then each process runs initialize_multiprocess: two
    setdefaults, then tpu.configure_topology(local_rank, local_world_size)."""
    with _environ(parent_env):
        processes = tpu.num_local_processes()
    envs = []
    for rank in range(processes):
        with _environ(parent_env):
            os.environ.setdefault("PJRT_LOCAL_PROCESS_RANK", str(rank))
            os.environ.setdefault("PJRT_LOCAL_PROCESS_COUNT", str(processes))
            tpu.configure_topology(rank, processes)
            envs.append({k: os.environ[k] for k in _PER_PROCESS if k in os.environ}
                        | {k: v for k, v in os.environ.items() if k.startswith("TPU_")})
    return envs


class _environ:
    """os.environ is ``env`` inside, and as it was after."""

    def __init__(self, env):
        self.env = dict(env)

    def __enter__(self):
        self.saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)

    def __exit__(self, *exc):
        os.environ.clear()
        os.environ.update(self.saved)


def topology_problems(envs, chips):
    """What libtpu would refuse or what would make replicas collide, in libtpu's words where
    it has them. Empty: consistent."""
    problems = []
    if not envs:
        return ["no process"]
    for rank, env in enumerate(envs):
        addresses = env["TPU_PROCESS_ADDRESSES"].split(",")
        bounds = _mesh(env["TPU_PROCESS_BOUNDS"])
        # 7x (torch_xla 2.9) adds a fourth dimension of 2, the chip's two TensorCores; the
        # processes are the first three.
        processes = _size(bounds[:3])
        if processes != len(addresses):
            problems.append(f"Expected {processes} worker addresses, got {len(addresses)}")
        if processes != len(envs):
            problems.append(f"process bounds {env['TPU_PROCESS_BOUNDS']} for {len(envs)} processes")
        per_process = _size(_mesh(env["TPU_CHIPS_PER_PROCESS_BOUNDS"]))
        if processes * per_process != chips:
            problems.append(f"{processes} x {per_process} chips in the bounds, {chips} on the bus")
        if not any(a.endswith(f":{env['TPU_PROCESS_PORT']}") for a in addresses):
            problems.append(f"process {rank}: port {env['TPU_PROCESS_PORT']} not in its addresses")
        if not 0 <= int(env["TPU_VISIBLE_CHIPS"]) < chips:
            problems.append(f"process {rank}: chip {env['TPU_VISIBLE_CHIPS']} not on the bus")
    for key in ("TPU_VISIBLE_CHIPS", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID",
                "PJRT_LOCAL_PROCESS_RANK"):
        values = [env.get(key) for env in envs]
        if len(set(values)) != len(values):
            problems.append(f"processes share {key}={values}")
    if len({env["TPU_PROCESS_ADDRESSES"] for env in envs}) != 1:
        problems.append("processes disagree on TPU_PROCESS_ADDRESSES")
    return sorted(set(problems))


def plan_for(host, tpu):
    """colab_xla's plan on this host, and the environment its replicas start from (the
    host's minus what colab_xla removes, plus what it sets: run_cell's own steps)."""
    env = dict(host["environ"])
    hw = hardware.detect(env)
    plan = plan_replicas(None, hw)
    changes = {**plan.env, **preflight.topology_changes(env, plan.env)}
    return hw, plan, replica_environ(changes, base=env)


def _torch_xla_knows(tpu, host):
    """Whether this torch_xla's own PCI table has the host's chips (2.8 lacks 7x)."""
    return tpu.num_available_chips() == host["facts"]["chips"]


# --- per host ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTS)
def test_plan_counts_each_host(name, fake_host, tpu):
    host, facts = HOSTS[name], HOSTS[name]["facts"]
    metadata = fake_host(host)
    hw = hardware.detect(host["environ"])
    assert (hw.tpu_chips, hw.tpu_generation) == (facts["chips"], facts["generation"])
    if not _torch_xla_knows(tpu, host):
        with pytest.raises(UnsupportedTpuError, match="does not know"):
            plan_replicas(None, hw)
        return
    plan = plan_replicas(None, hw)
    assert (plan.device_type, plan.replicas, plan.processes) == \
        ("TPU", facts["replicas"], facts["chips"])
    assert not metadata.asked.is_set()  # the PCI id said which TPU this is


@pytest.mark.parametrize("name", HOSTS)
def test_each_replica_process_gets_a_consistent_topology(name, fake_host, tpu):
    host = HOSTS[name]
    fake_host(host)
    if not _torch_xla_knows(tpu, host):
        pytest.skip("this torch_xla does not know the chip: colab_xla refuses (test above)")
    hw, plan, env = plan_for(host, tpu)
    envs = replay(tpu, env, chips=hw.tpu_chips)
    assert len(envs) == plan.processes == host["facts"]["chips"]
    assert topology_problems(envs, hw.tpu_chips) == []
    for key in ("TPU_SKIP_MDS_QUERY", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS",
                "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES"):
        assert all(e.get(key) == host["environ"].get(key) for e in envs), key  # kept


@pytest.mark.parametrize("name", HOSTS)
def test_without_colab_xla_the_known_symptom_appears_where_the_sources_report_it(
        name, fake_host, tpu):
    """The check above can fail: the host's own environment, as plain xmp.spawn would pass
    it on, gives libtpu's "Expected N worker addresses, got 1" on Kaggle (its
    TPU_PROCESS_ADDRESSES=local) and on Colab's one chip (its host bounds), not elsewhere."""
    host = HOSTS[name]
    fake_host(host)
    if not _torch_xla_knows(tpu, host):
        pytest.skip("this torch_xla does not know the chip")
    plain = {**host["environ"], "PJRT_DEVICE": "TPU"}
    problems = topology_problems(replay(tpu, plain, chips=host["facts"]["chips"]),
                                 host["facts"]["chips"])
    symptom = host["without_colab_xla"]
    assert (symptom in problems) if symptom else problems == []


@pytest.mark.parametrize("name", [n for n in HOSTS if HOSTS[n]["facts"]["replicas"]])
def test_n_that_the_host_cannot_run_says_the_chip_count_and_both_ways_out(name, fake_host, tpu):
    host, facts = HOSTS[name], HOSTS[name]["facts"]
    fake_host(host)
    if not _torch_xla_knows(tpu, host):
        pytest.skip("this torch_xla does not know the chip")
    hw = hardware.detect(host["environ"])
    assert plan_replicas(facts["replicas"], hw).replicas == facts["replicas"]
    asked = 8 if facts["replicas"] != 8 else 4
    with pytest.raises(ReplicaCountError) as info:
        plan_replicas(asked, hw)
    message = str(info.value)
    chips = f"{facts['chips']} TPU {facts['generation']} chip{'s' if facts['chips'] > 1 else ''}"
    assert message.startswith(f"-n {asked}: this host has {chips}")
    assert f"runs {facts['replicas']} replica" in message
    assert "Leave -n out" in message
    assert f"simulate {asked} replicas on CPU: os.environ['PJRT_DEVICE'] = 'CPU'" in message
    assert len(message) < 240 and message.count(". ") <= 2  # short: two sentences


def test_one_chip_colab_running_a_notebook_written_for_8_cpu_replicas(fake_host):
    host = HOSTS["colab-v5e-1"]
    fake_host(host)
    with pytest.raises(ReplicaCountError) as info:
        plan_replicas(8, hardware.detect(host["environ"]))
    assert str(info.value) == (
        "-n 8: this host has 1 TPU v5e chip, so it runs 1 replica. Leave -n out to run here, "
        "or simulate 8 replicas on CPU: os.environ['PJRT_DEVICE'] = 'CPU' in a cell before.")


# --- the metadata server ------------------------------------------------------------------


def test_a_metadata_server_that_never_answers_does_not_hold_the_plan(fake_host, monkeypatch):
    """A chip whose PCI id does not say its generation ("testing only" in torch_xla) and no
    TPU_ACCELERATOR_TYPE: colab_xla asks torch_xla, which asks the metadata server with no
    timeout. The plan comes back anyway, with the count left to xmp.spawn."""
    host = {**HOSTS["tpu-vm-v4-8"], "metadata": "never answers", "environ": {}}
    metadata = fake_host(host, pci={"device": "0x0062", "count": 4})
    monkeypatch.setattr(tpu_scan, "METADATA_TIMEOUT", 0.2)
    result = []
    worker = threading.Thread(target=lambda: result.append(hardware.detect({})), daemon=True)
    worker.start()
    worker.join(30)  # generous: it waits METADATA_TIMEOUT
    assert not worker.is_alive() and metadata.asked.is_set()
    hw = result[0]
    assert (hw.tpu_chips, hw.tpu_cores_per_chip) == (4, None)
    assert plan_replicas(None, hw).replicas is None


def test_the_metadata_answer_is_used_when_it_comes(fake_host):
    host = {**HOSTS["tpu-vm-v4-8"], "environ": {}}
    metadata = fake_host(host, pci={"device": "0x0062", "count": 4})
    hw = hardware.detect({})
    assert metadata.asked.is_set() and (hw.tpu_chips, hw.tpu_cores_per_chip) == (4, 1)


def test_tpu_accelerator_type_says_the_generation_without_the_metadata_server(fake_host):
    host = {**HOSTS["tpu-vm-v4-8"], "metadata": "never answers",
            "environ": {"TPU_ACCELERATOR_TYPE": "v3-8"}}
    metadata = fake_host(host, pci={"device": "0x0062", "count": 4})
    hw = hardware.detect(host["environ"])
    assert (hw.tpu_generation, hw.tpu_cores_per_chip) == ("v2/v3", 2)
    assert not metadata.asked.is_set()


# --- TPU 7x on a torch_xla without it -----------------------------------------------------


def test_7x_is_counted_by_colab_xla_when_torch_xla_does_not_know_it(fake_host, tpu, monkeypatch):
    """torch_xla 2.8's PCI table has no 7x: its xmp.spawn would start no process. Faked
    here by taking 7x out of torch_xla's own table."""
    host = HOSTS["tpu-vm-7x-8"]
    fake_host(host)
    monkeypatch.setattr(tpu, "_TPU_PCI_DEVICE_IDS",
                        [d for d in tpu._TPU_PCI_DEVICE_IDS if d != host["pci"]["device"]])
    with _environ({"PJRT_DEVICE": "TPU"}):
        assert tpu.num_local_processes() == 0  # what xmp.spawn would start
    hw = hardware.detect({})
    assert (hw.tpu_chips, hw.tpu_generation, hw.torch_xla_tpu_chips) == (4, "7x", 0)
    with pytest.raises(UnsupportedTpuError) as info:
        plan_replicas(None, hw)
    assert "4 TPU 7x chips" in str(info.value) and "2.9 or later" in str(info.value)


# --- what colab_xla removes ---------------------------------------------------------------


def test_kaggles_stale_address_is_removed_and_said(fake_host):
    env = HOSTS["kaggle-v5e-8"]["environ"]
    assert preflight.strip_topology(env) == ("TPU_PROCESS_ADDRESSES",)
    [note] = preflight.check(Cell("index"), env)["notes"]
    assert note.code == "topology" and "removes them for the replicas" in note.fix


def test_colabs_host_variables_are_kept_and_not_reported():
    env = HOSTS["colab-v5e-1"]["environ"]
    assert preflight.strip_topology(env) == ()
    assert preflight.check(Cell("index"), env) == {"fatal": [], "notes": []}


def test_bounds_that_are_torch_xlas_only_host_description_are_kept(fake_host, tpu):
    """With TPU_SKIP_MDS_QUERY and no TPU_HOST_BOUNDS (the GKE-style environment torch_xla
    reads instead of the metadata server, pytorch/xla#4499), TPU_PROCESS_BOUNDS and
    TPU_CHIPS_PER_PROCESS_BOUNDS are the host: without them configure_topology fails."""
    env = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v4-8", "TPU_WORKER_ID": "0",
           "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
           "TPU_VISIBLE_CHIPS": "0"}
    fake_host({**HOSTS["tpu-vm-v4-8"], "environ": env, "metadata": "never answers"})
    assert preflight.strip_topology(env) == ("TPU_VISIBLE_CHIPS",)
    hw, plan, replica_env = plan_for({"environ": env}, tpu)
    envs = replay(tpu, replica_env, chips=4)
    assert topology_problems(envs, 4) == []
    dropped = {k: v for k, v in replica_env.items() if k not in
               ("TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS")}
    with pytest.raises(Exception):  # MeshShape.from_string(None)
        replay(tpu, dropped, chips=4)
    with_host = {**env, "TPU_HOST_BOUNDS": "1,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"}
    assert preflight.strip_topology(with_host) == (
        "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS")


def test_the_plans_own_topology_is_not_removed():
    env = {"TPU_PROCESS_BOUNDS": "2,2,1", "TPU_PROCESS_ADDRESSES": "local"}
    changes = preflight.topology_changes(env, torch_xla_runtime.ONE_CHIP_TOPOLOGY)
    assert changes == {"TPU_PROCESS_ADDRESSES": None}
