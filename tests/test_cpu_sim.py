"""Units of colab_xla.runtimes.cpu_sim: the CPU plan's variables, and the check that refuses to
patch a torch_xla that lacks what the simulation patches (a later release that renamed it)."""

import types

import pytest

from colab_xla.runtimes import simulation as sim_plan
from colab_xla.runtimes import cpu_sim


pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


@pytest.mark.parametrize("replicas", [1, 2, 6, 7, 32])
def test_the_thread_pool_has_room_for_every_replica_in_a_collective(replicas):
    env = sim_plan.environment(replicas, simulation="threads")
    assert env["PJRT_DEVICE"] == "CPU" and env["CPU_NUM_DEVICES"] == str(replicas)
    # each replica blocks a pool thread in a collective: more threads than replicas, and
    # never fewer than a small machine's default
    assert int(env["XLA_THREAD_POOL_SIZE"]) > replicas
    assert int(env["XLA_THREAD_POOL_SIZE"]) >= 8
    assert ("XLA_ENABLE_PARAM_ALIASING" in env) == (replicas > 1)


@pytest.mark.parametrize("replicas", [2, 8, 32])
def test_replica_processes_have_one_cpu_device_each_and_no_thread_pool_to_size(replicas):
    env = sim_plan.environment(replicas)  # the default model
    assert sim_plan.DEFAULT_SIMULATION == "processes"
    assert env == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
                   "XLA_ENABLE_PARAM_ALIASING": "0"}


def test_one_replica_is_one_device_whatever_the_model():
    for simulation in sim_plan.SIMULATIONS:
        env = sim_plan.environment(1, simulation=simulation)
        assert env["CPU_NUM_DEVICES"] == "1" and "XLA_ENABLE_PARAM_ALIASING" not in env


def test_variables_the_user_set_are_left_to_them():
    env = sim_plan.environment(4, simulation="threads", thread_pool_set=True,
                              param_aliasing_set=True)
    assert env == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    env = sim_plan.environment(4, param_aliasing_set=True)
    assert env == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}


def _fakes(drop=()):
    xlac = types.SimpleNamespace(**{n: object() for n in cpu_sim.XLAC_FUNCTIONS if n not in drop})
    xm = types.SimpleNamespace(all_gather=object(), xla_rendezvous=object())
    return xlac, xm


def test_a_torch_xla_with_everything_needs_nothing():
    assert cpu_sim.missing(*_fakes()) == []


def test_a_renamed_private_function_is_named_and_the_note_says_what_to_do():
    lacking = cpu_sim.missing(*_fakes(drop=("_xla_sync_multi",)))
    assert lacking == ["torch_xla._XLAC._xla_sync_multi"]
    note = cpu_sim.unsupported_note(lacking, "9.9.0")
    assert "torch_xla 9.9.0" in note and "_xla_sync_multi" in note
    assert all(release in note for release in cpu_sim.TESTED_RELEASES)
    assert "-n 1" in note


def test_install_refuses_and_patches_nothing_when_something_is_missing(monkeypatch, capsys):
    torch_xla = pytest.importorskip("torch_xla")
    xlac, xm = _fakes(drop=("_xla_step_marker",))
    monkeypatch.setattr(torch_xla, "_XLAC", xlac)
    before = dict(vars(xlac)), dict(vars(xm))
    assert cpu_sim.install(xm) is False
    assert (dict(vars(xlac)), dict(vars(xm))) == before
    assert "_xla_step_marker" in capsys.readouterr().err


def test_the_installed_torch_xla_has_everything_the_simulation_patches():
    torch_xla = pytest.importorskip("torch_xla")
    import torch_xla.core.xla_model as xm

    assert cpu_sim.missing(torch_xla._XLAC, xm) == []
    assert torch_xla.__version__.rsplit(".", 1)[0] in cpu_sim.TESTED_RELEASES


# --- the processes model's collectives (colab_xla.runtimes.gloo_collectives) -----------

from colab_xla.runtimes import gloo_collectives  # noqa: E402


def _gloo_fakes(drop=()):
    def names(which):
        return types.SimpleNamespace(**{n: object() for n in which if n not in drop})
    return (names(gloo_collectives.RUNTIME_NAMES), names(gloo_collectives.XLA_MODEL_NAMES),
            names(gloo_collectives.XLAC_NAMES))


def test_the_processes_model_names_what_a_torch_xla_lacks():
    assert gloo_collectives.missing(*_gloo_fakes()) == []
    lacking = gloo_collectives.missing(*_gloo_fakes(drop=("_WORLD_SIZE", "xla_rendezvous")))
    assert lacking == ["torch_xla.runtime._WORLD_SIZE", "xla_model.xla_rendezvous"]


def test_an_unknown_reduce_type_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"Invalid reduce type: 'avg' \(one of sum, mul, and, "
                                         r"or, min, max\)"):
        gloo_collectives._reduce_op("avg")


def test_a_replica_outside_every_group_is_told_so():
    group_of = gloo_collectives.group_of
    assert group_of(2, None) is None and group_of(2, []) is None
    assert group_of(2, [[0, 1], [2, 3]]) == [2, 3]
    with pytest.raises(ValueError, match=r"replica 2 is in none of the groups \[\[0, 1\]\]"):
        group_of(2, [[0, 1]])
