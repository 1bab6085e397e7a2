"""Tutorial 06 (iterative training on a session, ``%xla_session``) in a real kernel.

The notebook runs once (module fixture) through ``run_notebooks.execute_notebook``; the tests
read its executed copy: the session's replicas are the same processes in every cell, what a
replica defined in one cell is used in the next, a learning rate set in the notebook reaches
the replicas' optimizer, the second training cell compiles nothing, ``--fresh`` runs on other
processes, and the model pulled from replica 0 is the notebook's ``Net`` and has learned.
"""

from __future__ import annotations

import re

import nbformat
import pytest

import run_notebooks  # tools/ is on sys.path (conftest.py)
from test_notebooks import assert_every_cell_ran, cell, replica_blocks, text_of  # noqa: E402

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(600)]

SESSION = run_notebooks.NOTEBOOKS_DIR / "06-warm-session.ipynb"
REPLICAS = 4
STEPS = 10
FIRST_LR, SECOND_LR = 0.5, 0.1
TIMEOUT = 240  # per cell
SESSION_CELLS = ("build", "train", "set-lr", "train-again", "pull")  # the session's cells


@pytest.fixture(scope="module")
def session_nb(tmp_path_factory):
    return run_notebooks.execute_notebook(SESSION, tmp_path_factory.mktemp("session"), TIMEOUT)[0]


def finished(text: str, n: int = REPLICAS):
    """``{ordinal: lines}`` of a run of ``n`` replicas that all finished."""
    assert re.search(rf"^{n} replicas on CPU: {n} done in \d+\.\d\d s"
                     r"( · results in `\w+`)?$", text, re.M), text
    blocks = replica_blocks(text)
    assert sorted(blocks) == list(range(n)), text
    for i, (heading, _) in blocks.items():
        assert re.fullmatch(rf"── replica {i} · done · \d+\.\d\d s", heading), heading
    return {i: lines for i, (_, lines) in blocks.items()}


def pids_of(text: str, n: int = REPLICAS):
    """``{ordinal: pid}`` from each replica's ``replica I: pid P, ...`` line."""
    pids = {}
    for i, lines in finished(text, n).items():
        found = [m for m in (re.match(rf"replica {i}: pid (\d+),", line) for line in lines) if m]
        assert len(found) == 1, (i, lines)
        pids[i] = int(found[0].group(1))
    return pids


def training(text: str):
    """``{ordinal: (losses, compilations before, after)}`` of a training cell."""
    found = {}
    for i, lines in finished(text).items():
        m = re.fullmatch(rf"replica {i}: pid \d+, loss ([\d.]+) -> ([\d.]+), "
                         r"compilations (\d+) -> (\d+)", lines[0])
        assert m, (i, lines)
        assert lines[1].startswith("Out: ["), (i, lines)
        losses = [float(v) for v in lines[1][len("Out: ["):-1].split(", ")]
        assert len(losses) == STEPS and (losses[0], losses[-1]) == (float(m[1]), float(m[2]))
        found[i] = (losses, int(m[3]), int(m[4]))
    return found


def test_sizes_are_parameters():  # (saved clean, with stable ids: see test_tutorials)
    nb = nbformat.read(SESSION, as_version=4)
    setup = cell(nb, "setup").source
    assert f"REPLICAS = {REPLICAS}" in setup and f"STEPS = {STEPS}" in setup, setup
    assert f"lr = {FIRST_LR}" in setup, setup
    assert cell(nb, "lr").source.strip() == f"lr = {SECOND_LR}"
    assert cell(nb, "start").source.strip() == "%xla_session start -n {REPLICAS}"
    for cell_id in SESSION_CELLS:  # they run on the session: no option of their own for that
        first = cell(nb, cell_id).source.splitlines()[0]
        assert first.startswith("%%xla_spawn") and "--fresh" not in first and " -n " not in first


def test_runs_without_errors(session_nb):
    assert_every_cell_ran(session_nb)


def test_every_session_cell_runs_on_the_replicas_started_once(session_nb):
    started = text_of(cell(session_nb, "start"))
    assert re.search(rf"^colab_xla session: {REPLICAS} replicas started in [\d.]+ s\.$",
                     started, re.M), started
    listed = {int(i): int(pid) for i, pid in
              re.findall(r"^  replica (\d+): pid (\d+), process \d+, memory ", started, re.M)}
    assert sorted(listed) == list(range(REPLICAS)), started
    assert len(set(listed.values())) == REPLICAS  # a process per replica
    for cell_id in ("build", "train", "set-lr", "train-again"):
        assert pids_of(text_of(cell(session_nb, cell_id))) == listed, cell_id
    finished(text_of(cell(session_nb, "pull")))
    status = text_of(cell(session_nb, "status"))
    # the five session cells above; the --fresh run is not one of the session's
    assert re.match(rf"colab_xla session: up \d+ s, {REPLICAS} replicas on CPU, simulated as "
                    r"processes, 5 cells run, started with fork\.", status), status
    assert {int(i): int(pid) for i, pid in re.findall(r"replica (\d+): pid (\d+)", status)} \
        == listed
    assert text_of(cell(session_nb, "stop")).splitlines() == [
        "colab_xla session: stopped.",
        "colab_xla session: none (%xla_session start starts one)."]


def test_replicas_keep_what_a_cell_defined_and_training_continues(session_nb):
    built = finished(text_of(cell(session_nb, "build")))
    for i, lines in built.items():  # nothing compiled yet: the model was only moved
        assert re.fullmatch(rf"replica {i}: pid \d+, lr {FIRST_LR}, compilations 0", lines[0])
    first = training(text_of(cell(session_nb, "train")))
    second = training(text_of(cell(session_nb, "train-again")))
    for i in range(REPLICAS):
        losses, again = first[i][0], second[i][0]
        assert all(b < a for a, b in zip(losses, losses[1:])), (i, losses)
        assert all(b < a for a, b in zip(again, again[1:])), (i, again)
        # the second cell starts from the model the first one left: below its last loss
        assert again[0] < losses[-1], (i, losses, again)
    assert len({losses[0] for losses, _, _ in first.values()}) > 1  # each replica its own batch
    assert text_of(cell(session_nb, "inspect")).splitlines()[1] == \
        "loss fell on every replica: True"
    assert text_of(cell(session_nb, "inspect-again")).splitlines()[1] == \
        "lower than after the first training cell on every replica: True"


def test_the_notebooks_new_lr_reaches_the_replicas_optimizer(session_nb):
    for i, lines in finished(text_of(cell(session_nb, "set-lr"))).items():
        assert lines == [lines[0]] and re.fullmatch(rf"replica {i}: pid \d+, lr {SECOND_LR}",
                                                    lines[0]), (i, lines)
    first = training(text_of(cell(session_nb, "train")))
    second = training(text_of(cell(session_nb, "train-again")))
    for i in range(REPLICAS):
        # lr 5 times smaller: the loss falls by much less per step than at the end of the
        # first cell (with lr unchanged it would fall by about as much)
        last_drop = first[i][0][-2] - first[i][0][-1]
        mean_drop = (second[i][0][0] - second[i][0][-1]) / (STEPS - 1)
        assert 0 < mean_drop < last_drop / 2, (i, first[i][0], second[i][0])


def test_the_second_training_cell_compiles_nothing(session_nb):
    first = training(text_of(cell(session_nb, "train")))
    second = training(text_of(cell(session_nb, "train-again")))
    for i in range(REPLICAS):
        _, before, after = first[i]
        assert before == 0 and after >= 1, (i, first[i])  # the first cell compiled the step
        assert second[i][1:] == (after, after), (i, second[i])  # ... and the second reused it


def test_fresh_runs_beside_the_session_on_other_processes(session_nb):
    session_pids = set(pids_of(text_of(cell(session_nb, "build"))).values())
    text = text_of(cell(session_nb, "fresh"))
    fresh = pids_of(text, 2)
    assert not set(fresh.values()) & session_pids, (fresh, session_pids)
    for i, lines in finished(text, 2).items():
        assert lines == [f"replica {i}: pid {fresh[i]}, has a model: False"], (i, lines)


def test_the_pulled_model_is_the_notebooks_net_and_has_learned(session_nb):
    blocks = finished(text_of(cell(session_nb, "pull")))
    assert "Pulled: model (Net)" in blocks[0]  # --pull-from 0: only replica 0 sends it
    assert not any(line.startswith("Pulled") for o in (1, 2, 3) for line in blocks[o])
    shown = text_of(cell(session_nb, "evaluate")).splitlines()
    assert shown[:2] == ["Net is the notebook's Net: True", "weights on: cpu"], shown
    m = re.fullmatch(r"accuracy on new points: (\d\.\d\d) untrained, (\d\.\d\d) trained", shown[2])
    assert m, shown
    untrained, trained = float(m[1]), float(m[2])
    assert trained > 0.7 and trained > untrained + 0.3, shown
