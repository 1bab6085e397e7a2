"""A run's outcome (colab_xla.notebook.outcome): its errors grouped, XlaSpawnError, the
ordinals' form, a launch that started no replica."""

import pickle

import pytest

from colab_xla.notebook.outcome import (DONE, FAILED, ReplicaOutcome, RunOutcome, XlaSpawnError,
                                        format_ordinals)
from colab_xla.notebook.views import text as text_view
from colab_xla.wire.reports import ReplicaError

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def _outcome_with_errors():
    boom = ReplicaError("exception", "ValueError", "boom", "Traceback...\nValueError: boom\n")
    other = ReplicaError("exception", "KeyError", "'k'", "Traceback...\nKeyError: 'k'\n")
    reps = {0: ReplicaOutcome(0, DONE, elapsed=0.1, has_value=True, value=0, value_repr="0"),
            1: ReplicaOutcome(1, FAILED, elapsed=0.1, error=boom),
            2: ReplicaOutcome(2, FAILED, elapsed=0.1, error=other),
            3: ReplicaOutcome(3, FAILED, elapsed=0.1, error=boom)}
    reps[0].log.write("stdout", "hello 0\n")
    return RunOutcome("CPU", reps, elapsed=0.5)


def test_errors_are_grouped_by_traceback_with_their_replicas():
    outcome = _outcome_with_errors()
    groups = outcome.error_groups()
    assert [(e.ename, ordinals) for e, ordinals in groups] == [("ValueError", [1, 3]),
                                                             ("KeyError", [2])]
    assert outcome.failed == [1, 2, 3] and not outcome.ok
    assert outcome.results() == {0: 0}


def test_spawn_error_shows_each_traceback_once():
    text = XlaSpawnError(_outcome_with_errors()).render()
    assert text.startswith("XlaSpawnError: 3 of 4 replicas failed (KeyError, ValueError)")
    assert text.count("ValueError: boom") == 1 and "[replicas 1, 3]" in text
    assert "[replica 2]" in text
    assert pickle.loads(pickle.dumps(_outcome_with_errors())).failed == [1, 2, 3]


def test_spawn_error_limits_the_tracebacks_it_draws():
    reps = {o: ReplicaOutcome(o, FAILED, error=ReplicaError("exception", "E", str(o), f"E: {o}"))
            for o in range(6)}
    text = XlaSpawnError(RunOutcome("CPU", reps)).render()
    assert text.count("E: ") == XlaSpawnError.max_tracebacks
    assert "2 more distinct errors on replicas 4-5" in text


@pytest.mark.parametrize("ordinals, text", [([], ""), ([3], "3"),
                                            ([0, 1, 2, 5, 7, 8], "0-2, 5, 7-8"),
                                            ([2, 1, 1], "1-2")])
def test_format_ordinals(ordinals, text):
    assert format_ordinals(ordinals) == text


def test_a_launch_that_starts_no_replica_is_reported_with_its_cause():
    from colab_xla.wire.reports import ReplicaError

    outcome = RunOutcome("NEURON", elapsed=0.1, launch_error=ReplicaError(
        "launch", "ModuleNotFoundError", "No module named 'libneuronxla'",
        "Traceback (most recent call last):\n"
        "ModuleNotFoundError: No module named 'libneuronxla'\n"))
    assert not outcome.ok
    error = str(XlaSpawnError(outcome))
    assert error.startswith("the replicas could not be started (ModuleNotFoundError: No module "
                            "named 'libneuronxla')")
    assert "Traceback" in error
    assert text_view.headline(outcome) == ("0 replicas on NEURON: not started "
                                           "(ModuleNotFoundError) in 0.10 s")


def test_the_states_count_each_replicas_state_as_both_views_say_them():
    outcome = RunOutcome("CPU", elapsed=0.5)
    for ordinal, state in enumerate(["done", "failed", "done", "stopped"]):
        outcome.replica(ordinal).state = state
    assert text_view.states(outcome) == "2 done, 1 failed, 1 stopped"
    assert text_view.headline(outcome) == "4 replicas on CPU: 2 done, 1 failed, 1 stopped in 0.50 s"
