"""``--runtime torch`` on a TPU host: TorchTPU (torch_tpu 0.2.0), in the users' stack
``torchtpu`` (stacks/torchtpu.txt). This machine has no TPU, so:

* the planning runs torch_tpu's own launch code (``set_tpu_launch_env``) on recorded hosts:
  the PCI bus it reads (``/sys/bus/pci/devices``, ``/dev/vfio``) is a directory of the test
  holding the vendor and device ids of a v5e-1, v5e-8 and v6e-8 host, and 4-chip hosts of a
  2-host and a 4-host slice;
* each plan is then handed to a process as a worker gets it, which calls TorchTPU's own
  ``init_process_group("tpu_dist")``: TorchTPU reads every variable it needs and fails only
  where the chip should be ("No jellyfish device found"), never on a missing or wrong
  variable; the variables its native runtime derives (``TPU_VISIBLE_CHIPS``, multislice
  mode) are read back through libc;
* the guard sees the notebook's own claim of the chips through torch_tpu's native device
  backend (``_device_ops_backend._is_initialized``, stubbed to what a TPU tensor makes it).

The gloo stand-in runs real cells in this stack too (tests/test_torch_runtime.py). What only
a TPU can confirm is listed in docs/torch.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from colab_xla import runtimes
from colab_xla.errors import SetupError
from colab_xla.notebook.launch import free_port
from colab_xla.runtimes import torch as torch_runtime
from colab_xla.runtimes.plan import Hardware, ReplicaCountError
from colab_xla.wire.host_rank import HostRank

torch_tpu_hardware = pytest.importorskip("torch_tpu._internal.utils.hardware")

pytestmark = [pytest.mark.stacks("torchtpu"), pytest.mark.timeout(300)]

TORCH = runtimes.get("torch")
# The PCI device ids of the generations (torch_tpu's own table keys them so).
V5E, V6E = "0x0063", "0x006f"

# Loaded first in the planning child (PYTHONPATH): torch_tpu's PCI scan reads the test's
# recorded bus instead of this machine's, through the one module it reads it with.
SHIM = textwrap.dedent("""
    import os, pathlib, types
    root = os.environ["COLAB_XLA_TEST_PCI_ROOT"]
    import torch_tpu._internal.utils.hardware as hardware

    def Path(*parts):
        path = str(pathlib.PurePosixPath(*parts))
        if path.startswith(("/sys/bus/pci", "/dev/vfio")):
            return pathlib.Path(root + path)
        return pathlib.Path(path)

    hardware.pathlib = types.SimpleNamespace(Path=Path)
    """)

# A worker of the plan: colab_xla's own replica half (torchrun's variables from the
# launcher's rank), then TorchTPU's own process group on a HashStore (no peers needed).
WORKER = textwrap.dedent("""
    import ctypes, json, os
    os.environ["TPU_SKIP_MDS_QUERY"] = "1"  # (no GCE metadata server here)
    import torch, torch.distributed as dist
    from torch_tpu import _loader
    from colab_xla.runtimes import torch as rt
    _loader._init_device("tpu")  # (registers "tpu" and "tpu_dist"; a TPU host does it itself)
    rt.join()
    os.environ.update(rt._membership)
    try:
        dist.init_process_group(rt.backend(), store=dist.HashStore(),
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    native = {k: (libc.getenv(k.encode()) or b"").decode()
              for k in ("TPU_VISIBLE_CHIPS", "MEGASCALE_PORT", "CLOUD_TPU_TASK_ID")}
    print("WORKER=" + json.dumps({"error": error, "native": native,
                                  "device": str(rt.device()), "backend": rt.backend()}))
    """)


@pytest.fixture
def recorded_host(tmp_path):
    """``recorded_host(device_id, chips)``: the environment in which torch_tpu's PCI scan
    finds that host."""
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(SHIM)

    def host(device_id: str, chips: int):
        root = tmp_path / f"pci-{device_id}-{chips}"
        (root / "dev" / "vfio").mkdir(parents=True)
        (root / "sys" / "kernel" / "iommu_groups").mkdir(parents=True)
        for chip in range(chips):
            device = root / "sys" / "bus" / "pci" / "devices" / f"0000:00:{4 + chip:02x}.0"
            device.mkdir(parents=True)
            (device / "vendor").write_text("0x1ae0\n")
            (device / "device").write_text(f"{device_id}\n")
            group = root / "sys" / "kernel" / "iommu_groups" / str(10 + chip)
            group.mkdir()
            (device / "iommu_group").symlink_to(group)
            (root / "dev" / "vfio" / str(10 + chip)).touch()
        return {"PYTHONPATH": str(tmp_path / "shim"), "COLAB_XLA_TEST_PCI_ROOT": str(root)}
    return host


def replicas_environ(plan, **more):
    """The replicas' environment of ``plan`` as the launcher hands it to run_environ."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update({k: v for k, v in plan.env.items() if v is not None})
    env.update(PJRT_LOCAL_PROCESS_COUNT=str(plan.processes), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    env.update(more)
    return env


def worker(environ, local_rank: int):
    """What TorchTPU makes of the plan in the process of local rank ``local_rank``."""
    env = {k: v for k, v in environ.items()
           if k not in ("PYTHONPATH", "COLAB_XLA_TEST_PCI_ROOT")}
    env["PJRT_LOCAL_PROCESS_RANK"] = str(local_rank)
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True,
                          text=True, timeout=200, cwd=os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))
    lines = [line for line in done.stdout.splitlines() if line.startswith("WORKER=")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1].partition("=")[2])


def assert_torchtpu_takes_it(found, local_rank: int):
    # TorchTPU read every variable and went on to open the chip, which is not here: the
    # error of a missing or malformed variable would be another.
    assert found["error"] and "No jellyfish device found" in found["error"], found
    assert found["native"]["TPU_VISIBLE_CHIPS"] == str(local_rank)  # its chip, by LOCAL_RANK
    assert found["native"]["MEGASCALE_PORT"] == ""  # one slice, not a multislice job
    assert (found["device"], found["backend"]) == ("tpu", "tpu_dist")


@pytest.mark.parametrize("device_id, chips", [(V5E, 1), (V5E, 8), (V6E, 8)],
                         ids=["v5e-1", "v5e-8", "v6e-8"])
def test_a_tpu_host_runs_one_process_per_chip_with_torchtpus_own_launch_environment(
        recorded_host, device_id, chips):
    plan = TORCH.plan(None, Hardware(pjrt_device=None, tpu_chips=chips), environ={})
    assert (plan.device_type, plan.processes, plan.env[torch_runtime.DEVICE]) == (
        "TPU", chips, "TPU")
    assert "one per TPU chip (TorchTPU, tpu_dist)" in plan.note
    environ = replicas_environ(plan, **recorded_host(device_id, chips))
    launch = TORCH.run_environ(environ, free_port)

    # What set_tpu_launch_env computes, as its own table gives it for this host.
    assert launch["TORCH_TPU_TOPOLOGY"] == (
        torch_tpu_hardware._TOPOLOGY_BY_TPU_PCI_DEVICE_ID[device_id][chips])
    addresses = launch["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert len(addresses) == chips and all(a.startswith("localhost:") for a in addresses)
    assert launch["TORCH_TPU_XPROF_SESSION_ID"]
    # The launcher's rendezvous is kept: TorchTPU never overwrites a variable.
    assert "MASTER_PORT" not in launch and "NODE_RANK" not in launch
    assert_torchtpu_takes_it(worker({**environ, **launch}, chips - 1), chips - 1)


@pytest.mark.parametrize("hosts, slice_topology", [(2, "2x4"), (4, "4x4")],
                         ids=["2-host", "4-host"])
def test_a_slices_hosts_are_one_job_with_host_0_the_master_and_global_ranks(
        recorded_host, hosts, slice_topology):
    described = [{"device": "TPU", "address": f"10.0.0.{2 + h}"} for h in range(hosts)]
    shared = TORCH.cluster_environ(described, lambda: "10.0.0.2:29555")
    last = hosts - 1
    rank = HostRank(host=last, hosts=hosts, replicas=4, address=described[last]["address"],
                    run="r1")
    plan = TORCH.plan(None, Hardware(pjrt_device=None, tpu_chips=4), environ={})
    environ = replicas_environ(plan, **recorded_host(V5E, 4), **rank.environ(), **shared,
                               TPU_TOPOLOGY=slice_topology)
    launch = TORCH.run_environ(environ, free_port)

    assert launch["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",") == [
        f"{d['address']}:{8070 + i}" for d in described for i in range(4)]
    assert (launch["NNODES"], launch["NODE_RANK"]) == (str(hosts), str(last))
    assert (launch["MASTER_ADDR"], launch["MASTER_PORT"]) == ("10.0.0.2", "29555")
    # The slice's, not this host's, in the form TorchTPU's native runtime reads ("2x4" is
    # refused there: "Incorrect number of elements specified for TPU dimensions").
    assert launch["TORCH_TPU_TOPOLOGY"] == torch_runtime.slice_topology(slice_topology)
    assert launch["TORCH_TPU_TOPOLOGY"].count(",") == 2

    found = worker({**environ, **launch}, 3)
    assert_torchtpu_takes_it(found, 3)
    assert found["native"]["CLOUD_TPU_TASK_ID"] == str(last * 4 + 3)  # the global rank


def test_a_host_without_chips_says_what_torchtpu_said_and_bad_counts_are_refused(
        recorded_host):
    plan = TORCH.plan(2, Hardware(pjrt_device=None, tpu_chips=4), environ={})
    environ = replicas_environ(plan, **recorded_host(V5E, 0))  # (the chips went away)
    with pytest.raises(SetupError, match="set_tpu_launch_env failed: .*expected TPU "
                                         "devices, got none"):
        TORCH.run_environ(environ, free_port)
    with pytest.raises(ReplicaCountError, match="-n 5: this host has 4 TPU chips"):
        TORCH.plan(5, Hardware(pjrt_device=None, tpu_chips=4), environ={})
    forced = TORCH.plan(2, Hardware(pjrt_device=None, tpu_chips=4),
                        environ={"PJRT_DEVICE": "CPU"})
    assert (forced.device_type, forced.env[torch_runtime.DEVICE]) == ("CPU", "CPU")


@pytest.mark.timeout(300)
def test_a_notebook_that_claimed_the_tpu_is_refused_before_forking_naming_the_cell():
    # In a fresh interpreter (the stub must not outlive the test): torch_tpu imported, a
    # cell that moves a tensor to the TPU, the native backend saying the chips are claimed
    # (what that cell does on a TPU host), and %%xla_spawn --runtime torch.
    probe = textwrap.dedent("""
        import torch, torch_tpu
        from torch_tpu._internal.device import _device_ops_backend as backend
        from IPython.core.error import UsageError
        from IPython.testing.globalipapp import start_ipython
        from colab_xla.runtimes import torch as rt
        ip = start_ipython()
        ip.run_line_magic("load_ext", "colab_xla")
        print("BEFORE", rt.tpu_problem())
        ip.user_ns["In"] = ["", "import torch_tpu", 'x = torch.ones(2).to("tpu")']
        backend._is_initialized = lambda: True
        try:
            ip.run_cell_magic("xla_spawn", "--runtime torch -n 2 --no-widget", "print(1)")
        except UsageError as exc:
            print("REFUSED", exc)
        """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=200, cwd=os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__))))
    assert "BEFORE None" in out.stdout, out.stderr[-3000:]  # importing torch_tpu is fine
    assert "REFUSED" in out.stdout and "The TPU is claimed by this notebook's own process" \
        in out.stdout, out.stdout + out.stderr[-3000:]
    assert "Likely: In[2] calls `.to(\"tpu`." in out.stdout
    assert "[replica 0]" not in out.stdout  # nothing forked


def test_the_doctor_names_torchtpu_the_chips_and_whether_this_notebook_holds_them(monkeypatch):
    from importlib.metadata import version

    from torch_tpu._internal.device import _device_ops_backend as backend

    from colab_xla.notebook.doctor import installed_version

    tpu_host = Hardware(pjrt_device=None, tpu_chips=4)
    facts = dict(torch_runtime.doctor_facts(tpu_host, {}, installed_version))
    assert facts["--runtime torch"] == (
        f"torch {version('torch')}, TorchTPU {version('torch-tpu')} (libtpu "
        f"{version('libtpu')}); 4 processes, one per TPU chip (TorchTPU, tpu_dist).")
    assert facts["  its device"] == "not opened by this notebook (good)"
    monkeypatch.setattr(backend, "_is_initialized", lambda: True)
    claimed = dict(torch_runtime.doctor_facts(tpu_host, {}, installed_version))
    assert claimed["  its device"].startswith("The TPU is claimed by this notebook's own process")


def test_a_run_torchtpu_refuses_is_not_started_and_says_why(recorded_host, monkeypatch):
    # Through the core as %%xla_spawn runs it: the plan of a 2-chip host, and TorchTPU's
    # launch code (in the launcher, before any process) seeing no chip.
    from colab_xla.notebook.launch import Launch
    from colab_xla.notebook.targets import run_cell

    tpu_host = Hardware(pjrt_device=None, tpu_chips=2)
    planned = torch_runtime.plan
    monkeypatch.setattr(type(TORCH), "plan",
                        lambda self, requested, hardware, **kw: planned(requested, tpu_host, {}))
    for key, value in recorded_host(V5E, 0).items():
        monkeypatch.setenv(key, value)
    outcome = run_cell("print(index)", launch=Launch(runtime=TORCH), announce=None,
                       label="Cell In[1]", replicas=2)
    assert outcome.replicas == {} and not outcome.ok
    error = outcome.launch_error
    assert (error.kind, error.ename) == ("launch", "SetupError")
    assert "set_tpu_launch_env failed: ValueError: set_tpu_launch_env(): expected TPU " \
           "devices, got none" in error.evalue
