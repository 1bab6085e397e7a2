"""Units of the runtimes' registry and interface (colab_xla.runtimes): every registered
runtime implements the whole interface, a name comes back as its runtime or a refusal
naming the choices, a replica finds its runtime in its environment, and what the
notebook's modules ask of a runtime (launch options, the launcher's variables, a
cluster's hosts, values for the host) gives what those modules decided before. No kernel,
no XLA runtime, no JAX backend."""

from __future__ import annotations

import copy
import inspect
import pickle
import re

import pytest

from colab_xla import runtimes
from colab_xla.errors import OptionError, Problem
from colab_xla.notebook.launch import Launch
from colab_xla.runtimes import jax as jax_runtime, torch as torch_runtime
from colab_xla.runtimes import torch_xla as torch_xla_runtime
from colab_xla.runtimes.base import Runtime
from colab_xla.runtimes.plan import Hardware

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]

TORCH_XLA, JAX = torch_xla_runtime.RUNTIME, jax_runtime.RUNTIME
INTERFACE = sorted(Runtime.__abstractmethods__)


# -- the registry -----------------------------------------------------------------------------

def test_the_registry_has_every_runtime_by_name_the_default_first():
    assert runtimes.RUNTIMES == ("torch_xla", "jax", "torch")  # --runtime's choices, in order
    assert runtimes.registered() == (TORCH_XLA, JAX, torch_runtime.RUNTIME)
    assert [r.name for r in runtimes.registered()] == list(runtimes.RUNTIMES)
    assert runtimes.get() is TORCH_XLA and runtimes.get(None) is TORCH_XLA
    assert runtimes.get("torch_xla") is TORCH_XLA and runtimes.get("jax") is JAX
    assert runtimes.get(JAX) is JAX  # a runtime is its own


@pytest.mark.parametrize("name", ["nope", "tensorflow", "", "JAX"])
def test_an_unknown_name_is_refused_naming_the_choices(name):
    with pytest.raises(OptionError) as info:
        runtimes.get(name)
    assert str(info.value) == f"--runtime {name}: use torch_xla (the default), jax or torch."


def test_the_choices_read_well_for_any_number_of_runtimes(monkeypatch):
    class Other(type(JAX)):
        name = "tensorflow"

    monkeypatch.setattr(runtimes, "_REGISTERED",
                        {**runtimes._REGISTERED, "tensorflow": Other()})
    monkeypatch.setattr(runtimes, "RUNTIMES", ("torch_xla", "jax", "torch", "tensorflow"))
    with pytest.raises(OptionError, match=re.escape(
            "--runtime nope: use torch_xla (the default), jax, torch or tensorflow.")):
        runtimes.get("nope")
    assert runtimes.get("tensorflow").name == "tensorflow"
    monkeypatch.setattr(runtimes, "RUNTIMES", ("torch_xla",))
    with pytest.raises(OptionError, match=re.escape("--runtime nope: use torch_xla (the "
                                                    "default).")):
        runtimes.get("nope")


def test_a_replica_finds_its_runtime_in_its_environment():
    assert runtimes.current({}) is TORCH_XLA  # the default plans set nothing
    assert runtimes.current({runtimes.VARIABLE: "jax"}) is JAX
    assert runtimes.current({runtimes.VARIABLE: "torch_xla"}) is TORCH_XLA
    assert runtimes.current({runtimes.VARIABLE: "nope"}) is TORCH_XLA  # (as before: not jax)
    assert runtimes.VARIABLE == "COLAB_XLA_RUNTIME"
    assert JAX.plan(2, Hardware(pjrt_device="CPU")).env[runtimes.VARIABLE] == "jax"


def test_a_problem_says_which_runtime_started_in_the_notebook():
    assert runtimes.started_by(Problem("runtime-initialized", "m", "f")) is TORCH_XLA
    assert runtimes.started_by(Problem(jax_runtime.BACKEND_STARTED, "m", "f")) is JAX
    assert runtimes.started_by(Problem("spmd", "m", "f")) is None
    assert len({r.started_code for r in runtimes.registered()}) == len(runtimes.RUNTIMES)


# -- the interface -----------------------------------------------------------------------------

def test_the_interface_has_both_halves():
    assert INTERFACE == sorted([
        "check_installed", "check_launch", "plan", "own_processes", "problems",
        "run_environ", "cluster_replicas", "check_cluster", "cluster_environ",
        "start_process", "device", "before_cell", "after_process", "to_host"])


@pytest.mark.parametrize("runtime", runtimes.registered(), ids=runtimes.RUNTIMES)
def test_every_registered_runtime_implements_every_method_and_names_itself(runtime):
    cls = type(runtime)
    for method in INTERFACE:
        implemented = getattr(cls, method)
        assert implemented is not getattr(Runtime, method), f"{cls.__name__}.{method}"
        assert (list(inspect.signature(implemented).parameters)
                == list(inspect.signature(getattr(Runtime, method)).parameters)), method
    assert runtime.name in runtimes.RUNTIMES and runtime.__module__ == \
        f"colab_xla.runtimes.{runtime.name}"  # one module per runtime, named for it
    assert isinstance(runtime.started_code, str)
    assert isinstance(runtime.starting_calls, re.Pattern)
    assert runtime.described_as is None or isinstance(runtime.described_as, str)


def test_a_runtime_that_lacks_a_method_cannot_be_made():
    class Partial(Runtime):
        name = "partial"

        def plan(self, requested, hardware, *, simulate=None, devices_per_process=None,
                 environ=None):
            raise NotImplementedError

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_runtimes_are_values_a_copy_is_the_same_runtime_and_prints_as_its_name():
    for runtime in runtimes.registered():
        assert copy.copy(runtime) == runtime and pickle.loads(pickle.dumps(runtime)) == runtime
        assert hash(copy.copy(runtime)) == hash(runtime)
        assert str(runtime) == runtime.name
        assert f"--runtime {runtime}" == f"--runtime {runtime.name}"
    assert TORCH_XLA != JAX
    assert Launch(runtime="jax") == Launch(runtime=JAX) and Launch() == Launch(runtime="torch_xla")
    assert Launch().runtime is TORCH_XLA


# -- the notebook's half, as the notebook's modules ask it ------------------------------------

def test_launch_options_are_checked_by_the_runtime_they_belong_to():
    with pytest.raises(OptionError, match="--launcher and --debug-single are torch_xla's"):
        JAX.check_launch(Launch(launcher="launch"))
    with pytest.raises(OptionError, match="--launcher and --debug-single are torch_xla's"):
        JAX.check_launch(Launch(debug_single=True))
    with pytest.raises(OptionError, match="--devices-per-process is for --runtime jax"):
        TORCH_XLA.check_launch(Launch(runtime="jax", devices_per_process=2))
    JAX.check_launch(Launch(runtime="jax", devices_per_process=2))
    TORCH_XLA.check_launch(Launch(launcher="launch", debug_single=True))
    assert Launch("spawn").describe() == "spawn"  # torch_xla adds nothing
    assert Launch("spawn", runtime="jax").describe() == "spawn, JAX processes (jax.distributed)"


def test_who_starts_the_processes_is_the_runtimes_answer():
    cpu = Hardware(pjrt_device="CPU")
    assert TORCH_XLA.plan(4, cpu).own_processes  # the simulation's processes
    assert not TORCH_XLA.plan(4, cpu, simulate="threads").own_processes  # xmp.spawn's
    assert TORCH_XLA.plan(1, cpu).own_processes  # one, in its main thread: interruptible
    assert not TORCH_XLA.plan(1, cpu, simulate="threads").own_processes
    assert JAX.plan(1, cpu).own_processes  # never xmp.spawn's


def test_the_launcher_adds_a_coordinator_for_jax_processes_unless_a_host_brought_one():
    # A Unix socket in the run's private directory; 127.0.0.1 where its path is too long.
    ports = iter([4321, 4322])
    sockets = {"jax-coordinator": "/tmp/u/run-1/jax-coordinator"}
    assert JAX.run_environ({}, lambda: next(ports), sockets.get) == {
        jax_runtime.COORDINATOR: "unix:/tmp/u/run-1/jax-coordinator"}
    assert JAX.run_environ({}, lambda: next(ports), lambda name: None) == {
        jax_runtime.COORDINATOR: "127.0.0.1:4321"}
    assert JAX.run_environ({jax_runtime.COORDINATOR: "10.0.0.2:5"}, lambda: next(ports),
                           sockets.get) == {}
    assert TORCH_XLA.run_environ({}, lambda: next(ports), sockets.get) == {}
    assert next(ports) == 4322  # (neither asked for a port it does not use)


def test_a_runs_unix_socket_is_in_its_directory_unless_the_path_would_be_too_long():
    from colab_xla.notebook import launch, state

    short = "/tmp/colab_xla-0/work/1-2.00/run-abcdefgh"
    assert launch.run_socket(short, "jax-coordinator") == short + "/jax-coordinator"
    long = "/tmp/" + "d" * (state.MAX_SOCKET_PATH - len("/tmp//jax-coordinator") + 1)
    assert len(long + "/jax-coordinator") == state.MAX_SOCKET_PATH + 1
    assert launch.run_socket(long, "jax-coordinator") is None
    assert launch.run_socket(long[:-1], "jax-coordinator") == long[:-1] + "/jax-coordinator"


def test_on_a_cluster_the_runtime_says_each_hosts_replicas_and_what_they_share():
    tpu, cpu = {"device": "TPU", "replicas": 4}, {"device": "CPU", "replicas": 2}
    assert [TORCH_XLA.cluster_replicas(h) for h in (tpu, cpu)] == [4, 2]
    assert [JAX.cluster_replicas(h) for h in (tpu, cpu)] == [1, 2]  # one process per TPU host

    def host_0():
        return "10.0.0.2:1234"

    assert JAX.cluster_environ([cpu], host_0) == {jax_runtime.COORDINATOR: "10.0.0.2:1234"}
    assert TORCH_XLA.cluster_environ([tpu], lambda: pytest.fail("torch_xla asked for a port")) == {}
    TORCH_XLA.check_cluster([tpu], Launch())
    with pytest.raises(OptionError, match="--devices-per-process 2: on a TPU host"):
        JAX.check_cluster([cpu, tpu], Launch(runtime="jax", devices_per_process=2))


# -- the replica's half (what can run without a backend) ---------------------------------------

def test_the_replica_half_of_each_runtime(monkeypatch):
    value = {"a": [1, (2.0, "x")]}
    assert TORCH_XLA.to_host(value) is value  # as is: XLA tensors move when pickled
    assert JAX.to_host(value) == value
    assert TORCH_XLA.before_cell() is None and TORCH_XLA.after_process() is None
    joined = []
    monkeypatch.setattr(jax_runtime, "join", lambda: joined.append(True))
    JAX.start_process(object(), object())
    assert joined == [True]
    monkeypatch.setattr(jax_runtime, "_initialized", False)
    JAX.after_process()  # (never initialized: nothing to leave)
