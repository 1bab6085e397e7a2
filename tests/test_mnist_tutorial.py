"""Tutorial 03 (MNIST on one device, then on every replica), run in a real kernel.

The notebook runs once (module fixture) through ``run_notebooks.execute_notebook``; the tests
read its executed copy: the loss lines of the single device and of every replica, the check
that the replicas' parameters are identical, and the trained model used in the notebook.
"""

from __future__ import annotations

import re

import pytest

import nbformat  # the test command installs every layer's tools: a missing one fails

import run_notebooks  # noqa: E402  (tools/ is on sys.path: conftest.py)
# tests/ is on sys.path (rootdir-relative import mode): the notebook readers of test_notebooks
from test_notebooks import assert_every_cell_ran, cell, replica_blocks, text_of  # noqa: E402

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(600)]

MNIST = run_notebooks.NOTEBOOKS_DIR / "03-mnist-every-replica.ipynb"
REPLICAS = 4
STEPS = 8
PRINTED = [0, 4, 7]  # the steps whose loss the cells print
TIMEOUT = 240  # per cell


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    return run_notebooks.execute_notebook(MNIST, tmp_path_factory.mktemp("mnist"), TIMEOUT)


def losses(text: str, n: int):
    """``{ordinal: [(step, loss), ...]}`` of a finished run of ``n`` replicas."""
    word = "replica" if n == 1 else "replicas"
    assert re.search(rf"^{n} {word} on CPU: {n} done in \d+\.\d\d s"
                     r"( · results in `\w+`)?$", text, re.M), text
    blocks = replica_blocks(text)
    assert sorted(blocks) == list(range(n)), text
    found = {}
    for i, (heading, lines) in blocks.items():
        assert re.fullmatch(rf"── replica {i} · done · \d+\.\d\d s", heading), heading
        steps = [re.fullmatch(r"step (\d+) loss (\d+\.\d{4})", line) for line in lines
                 if line.startswith("step ")]
        assert all(steps), (i, lines)
        found[i] = [(int(m.group(1)), float(m.group(2))) for m in steps]
        assert [s for s, _ in found[i]] == PRINTED, (i, lines)
        assert any(line.startswith("Out: ") and "conv.weight" in line for line in lines), (i, lines)
    return found


def test_sizes_are_parameters():  # saved clean with stable ids: see test_tutorials.py
    nb = nbformat.read(MNIST, as_version=4)
    setup = cell(nb, "setup").source
    assert f"REPLICAS = {REPLICAS}" in setup and f"STEPS = {STEPS}" in setup, setup
    assert cell(nb, "replicas").source.startswith("%%xla_spawn -n {REPLICAS} -o trained")


def test_runs_without_errors(mnist):
    nb, _, ipynb_path = mnist
    assert ipynb_path.exists()
    assert_every_cell_ran(nb)


def test_single_device_trains(mnist):
    nb = mnist[0]
    (single,) = losses(text_of(cell(nb, "single")), 1).values()
    assert all(0.0 < loss < 5.0 for _, loss in single), single
    assert single[-1][1] < single[0][1], single  # one batch, seen 8 times: the loss falls


def test_every_replica_prints_its_loss(mnist):
    nb = mnist[0]
    found = losses(text_of(cell(nb, "replicas")), REPLICAS)
    for i, steps in found.items():
        assert all(0.0 < loss < 5.0 for _, loss in steps), (i, steps)
    # each replica trains on its own random batch: their losses are their own
    assert len({steps[0][1] for steps in found.values()}) > 1, found


def test_replicas_end_with_identical_parameters(mnist):
    nb = mnist[0]
    shown = text_of(cell(nb, "check")).splitlines()
    assert shown[0] == f"parameters identical on all {REPLICAS} replicas: True", shown
    # batch norm's running statistics are per-replica buffers
    assert re.fullmatch(r"per-replica buffers that differ: \[.*\]", shown[1]), shown
    assert set(re.findall(r"'([^']+)'", shown[1])) <= {"bn.running_mean", "bn.running_var"}, shown


def test_trained_state_is_used_in_the_notebook(mnist):
    nb = mnist[0]
    assert text_of(cell(nb, "load")).strip() == "output shape: (5, 10)"
