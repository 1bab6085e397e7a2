"""Units of the torch_xla runtime (colab_xla.runtimes.torch_xla), its notebook half: the plan
(device, replica count, processes, the replicas' variables) as a pure function of what
detection found, and what it refuses before start. No kernel, no XLA runtime."""

import os
import sys

import pytest

from colab_xla.notebook import hardware
from colab_xla.notebook.torch_xla_import import import_torch_xla
from colab_xla.runtimes import torch_xla as torch_xla_runtime
from colab_xla.runtimes.plan import DeviceMissing, Hardware, ReplicaCountError
from colab_xla.runtimes.torch_xla import plan_replicas

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]

# --- replica plan ------------------------------------------------------------------------


def test_cpu_plan_defaults_to_a_simulated_tpu_host_and_says_so():
    plan = plan_replicas(None, Hardware(pjrt_device=None))
    n = torch_xla_runtime.DEFAULT_CPU_REPLICAS
    assert (plan.device_type, plan.replicas, plan.processes) == ("CPU", n, n)
    assert plan.simulation == "processes" and plan.own_processes
    assert plan.env == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
                        "XLA_ENABLE_PARAM_ALIASING": "0"}  # see test_collectives
    assert "no TPU found" in plan.note and f"{n} replicas on CPU" in plan.note
    assert "one process each, like a TPU v4 or later host" in plan.note


def test_cpu_plan_of_threads_is_one_process_with_a_device_per_replica():
    plan = plan_replicas(None, Hardware(pjrt_device=None), "threads")
    n = torch_xla_runtime.DEFAULT_CPU_REPLICAS
    assert (plan.replicas, plan.processes, plan.own_processes) == (n, 1, False)
    assert plan.env == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(n),
                        "XLA_THREAD_POOL_SIZE": str(max(n + 2, 8)),  # see the next test
                        "XLA_ENABLE_PARAM_ALIASING": "0"}
    assert "threads of one process, like a TPU v2/v3 host" in plan.note


def test_one_cpu_replica_is_one_process_of_colab_xlas():
    # Not xmp.spawn's: its one CPU process runs the replica in a thread of a pool, where an
    # Interrupt cannot stop a time.sleep, and ended every session at N=1 (issue 31).
    plan = plan_replicas(1, Hardware(pjrt_device=None))
    assert (plan.replicas, plan.processes, plan.own_processes) == (1, 1, True)
    assert "running 1 replica on CPU (one process;" in plan.note


@pytest.mark.parametrize("n", [1, 2, 6, 7, 16])
def test_cpu_plan_gives_xla_a_pool_thread_per_replica_and_two_more_and_at_least_8(n):
    # A collective holds one XLA pool thread per replica until all have arrived; the rule
    # the torch_xla plan applies is max(n + 2, 8).
    env = plan_replicas(n, Hardware(pjrt_device="CPU"), "threads").env
    assert int(env["XLA_THREAD_POOL_SIZE"]) >= n + 2 and int(env["XLA_THREAD_POOL_SIZE"]) >= 8
    assert env["XLA_THREAD_POOL_SIZE"] == str(max(n + 2, 8))


def test_cpu_plan_honours_n_and_cpu_num_devices_and_explicit_device():
    hw = Hardware(pjrt_device="CPU", cpu_num_devices=3)
    assert plan_replicas(None, hw).replicas == 3
    plan = plan_replicas(5, hw)
    assert (plan.replicas, plan.processes, plan.env["CPU_NUM_DEVICES"]) == (5, 5, "1")
    assert plan_replicas(5, hw, "threads").env["CPU_NUM_DEVICES"] == "5"
    assert plan.note is None  # the user chose CPU: nothing to announce
    mine = Hardware(pjrt_device="CPU", xla_thread_pool_size="3", param_aliasing="1")
    env = plan_replicas(4, mine, "threads").env
    # the user's stay
    assert "XLA_THREAD_POOL_SIZE" not in env and "XLA_ENABLE_PARAM_ALIASING" not in env
    assert "XLA_ENABLE_PARAM_ALIASING" not in plan_replicas(1, hw).env  # nothing to simulate


@pytest.mark.parametrize("n", [0, -2])
def test_replica_count_below_one_is_refused(n):
    with pytest.raises(ReplicaCountError, match="1 or more"):
        plan_replicas(n, Hardware(pjrt_device=None))


def test_tpu_plan_takes_every_core_and_explains_other_counts():
    hw = Hardware(pjrt_device=None, tpu_chips=4, tpu_cores_per_chip=2)
    plan = plan_replicas(None, hw)
    assert (plan.device_type, plan.replicas, plan.env) == ("TPU", 8, {"PJRT_DEVICE": "TPU"})
    assert plan_replicas(8, hw).replicas == 8
    with pytest.raises(ReplicaCountError) as info:
        plan_replicas(4, hw)
    message = str(info.value)
    assert message.startswith("-n 4: this host has 4 TPU chips of 2 cores, so it runs 8 replicas.")
    assert "Leave -n out" in message and "os.environ['PJRT_DEVICE'] = 'CPU'" in message


def test_tpu_plan_with_unknown_core_count_accepts_only_the_default():
    hw = Hardware(pjrt_device="TPU", tpu_chips=4, tpu_cores_per_chip=None)
    assert plan_replicas(None, hw).replicas is None
    with pytest.raises(ReplicaCountError, match="could not be read"):
        plan_replicas(8, hw)


def test_other_devices_refuse_n():
    hw = Hardware(pjrt_device="CUDA", device_files=("/dev/nvidia0",))
    assert plan_replicas(None, hw).env == {"PJRT_DEVICE": "CUDA"}
    with pytest.raises(ReplicaCountError, match="CUDA_NUM_DEVICES"):
        plan_replicas(2, hw)


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_cpu_num_devices_that_is_not_a_count_is_refused_unless_n_is_given(value):
    hw = hardware.detect({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": value})
    with pytest.raises(ReplicaCountError) as info:
        plan_replicas(None, hw)  # it silently gave 8 replicas
    assert str(info.value).startswith(
        f"CPU_NUM_DEVICES='{value}': the number of replicas to simulate on CPU must be a whole "
        "number, 1 or more. Set one (os.environ['CPU_NUM_DEVICES'] = '4')")
    assert plan_replicas(3, hw).replicas == 3  # -n takes its place


def test_a_replica_count_beyond_what_cpu_collectives_can_join_is_refused():
    cap = torch_xla_runtime.MAX_CPU_REPLICAS
    assert plan_replicas(cap, Hardware(pjrt_device="CPU")).replicas == cap
    with pytest.raises(ReplicaCountError, match="XLA's CPU collectives abort"):
        plan_replicas(cap + 1, Hardware(pjrt_device="CPU"), "threads")
    with pytest.raises(ReplicaCountError, match=f"-n 1000000: at most {cap} replicas"):
        plan_replicas(1000000, Hardware(pjrt_device=None))
    with pytest.raises(ReplicaCountError, match=f"CPU_NUM_DEVICES=5000: at most {cap}"):
        plan_replicas(None, hardware.detect({"PJRT_DEVICE": "CPU",
                                                      "CPU_NUM_DEVICES": "5000"}))


def test_runtime_initialized_is_false_without_torch_xla(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_xla", raising=False)
    assert torch_xla_runtime.runtime_initialized() is False


def test_missing_torch_xla_gives_an_install_hint(monkeypatch):
    for name in list(sys.modules):
        if name == "torch_xla" or name.startswith("torch_xla."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # import fails as if not installed
    with pytest.raises(torch_xla_runtime.TorchXlaMissing, match="pip install torch torch_xla"):
        import_torch_xla()
    assert "PJRT_SELECT_DEFAULT_DEVICE" not in os.environ



# --- devices this machine does not have ------------------------------------------------------


@pytest.mark.parametrize("device, named", [("TPU", "no TPU"), ("CUDA", "no NVIDIA GPU"),
                                           ("GPU", "no NVIDIA GPU")])
def test_a_device_the_machine_does_not_have_is_refused_with_the_way_to_cpu(device, named):
    hw = Hardware(pjrt_device=device, tpu_chips=0, device_files=())
    with pytest.raises(DeviceMissing) as info:
        plan_replicas(None, hw)
    message = str(info.value)
    assert f"PJRT_DEVICE={device}, but this machine has {named}" in message
    assert "PJRT_DEVICE=CPU" in message and "os.environ.pop('PJRT_DEVICE')" in message


def test_a_device_shown_by_its_device_files_is_not_refused():
    # A container may show a TPU's device files but not its PCI bus: xmp.spawn still knows.
    hw = Hardware(pjrt_device="TPU", tpu_chips=0, device_files=("/dev/vfio/0",))
    assert plan_replicas(None, hw).device_type == "TPU"
    gpu = Hardware(pjrt_device="CUDA", device_files=("/dev/nvidia0",))
    assert plan_replicas(None, gpu).device_type == "CUDA"


# --- the runtime's notebook half, as the notebook asks it ----------------------------------


def test_every_plan_is_the_torch_xla_runtimes_and_the_runtime_says_who_starts_its_processes():
    runtime = torch_xla_runtime.RUNTIME
    for plan in (plan_replicas(None, Hardware(pjrt_device=None)),
                 plan_replicas(None, Hardware(pjrt_device=None, tpu_chips=4,
                                              tpu_cores_per_chip=1)),
                 plan_replicas(None, Hardware(pjrt_device="CUDA",
                                              device_files=("/dev/nvidia0",)))):
        assert plan.runtime is runtime
        assert plan.own_processes == runtime.own_processes(plan)
    # The runtime's plan() is plan_replicas, the simulation given by keyword (default: processes).
    hw = Hardware(pjrt_device=None)
    assert runtime.plan(3, hw) == plan_replicas(3, hw)
    assert runtime.plan(3, hw, simulate="threads") == plan_replicas(3, hw, "threads")
    assert "COLAB_XLA_RUNTIME" not in runtime.plan(3, hw).env  # the default: replicas' own


def test_the_xla_runtime_initialized_in_the_notebook_is_the_refusal(monkeypatch):
    runtime = torch_xla_runtime.RUNTIME
    monkeypatch.setattr(torch_xla_runtime, "runtime_initialized", lambda: False)
    assert runtime.problems() == []
    monkeypatch.setattr(torch_xla_runtime, "runtime_initialized", lambda: True)
    [problem] = runtime.problems()
    assert problem.fatal and problem.code == runtime.started_code == "runtime-initialized"
    assert problem.message == torch_xla_runtime.RUNTIME_INITIALIZED
    assert problem.fix == torch_xla_runtime.RUNTIME_INITIALIZED_FIX


def test_check_installed_gives_the_install_hint_where_torch_xla_is_missing(monkeypatch):
    torch_xla_runtime.RUNTIME.check_installed()  # (installed here)
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # as if not installed
    with pytest.raises(torch_xla_runtime.TorchXlaMissing, match="pip install torch torch_xla"):
        torch_xla_runtime.RUNTIME.check_installed()


def test_a_cpu_run_meets_at_a_port_of_its_own_and_a_tpu_or_a_cluster_host_finds_its_own():
    from colab_xla.wire.host_rank import HostRank

    runtime = torch_xla_runtime.TorchXla()
    ports = iter([4101, 4102])
    assert runtime.run_environ({"PJRT_DEVICE": "CPU"}, lambda: next(ports)) == {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4101"}
    assert runtime.run_environ({"PJRT_DEVICE": "CPU", "MASTER_PORT": "7000"},
                               lambda: next(ports)) == {"MASTER_ADDR": "127.0.0.1"}
    host = HostRank(host=1, hosts=2, replicas=4, address="10.0.0.3").environ()
    for environ in ({"PJRT_DEVICE": "TPU"}, {}, {"PJRT_DEVICE": "CPU", **host}):
        assert runtime.run_environ(environ, lambda: next(ports)) == {}
