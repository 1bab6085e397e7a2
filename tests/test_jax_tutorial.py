"""Tutorial 08 (a torchax model trained on 2 JAX processes, ``--runtime jax``) in a real kernel.

The notebook runs once (module fixture) through ``run_notebooks.execute_notebook``; it starts a
session of 2 JAX processes on CPU. The tests read its executed copy: every session cell ran in
both processes (the pids the session started), each with ``jax.distributed`` giving one global
set of 2 devices; the loss of the data-parallel training (a torch ``nn.Module`` made a JAX
function by torchax, the batch split across the processes) is the same in both and falls; the
final weights' checksum is the same in both processes and in the notebook, which compares the
pulled weights exactly and evaluates them; the notebook's own process never started a JAX
backend; the TPU variant is one line.

jax and flax are the dev stack's (torch_xla 2.9's bundled torchax imports flax): the users'
stacks of stacks/ have neither: there, the tests that run the notebook skip.
"""

from __future__ import annotations

import importlib.util
import re

import nbformat
import pytest

import run_notebooks  # tools/ is on sys.path (conftest.py)
from test_notebooks import assert_every_cell_ran, cell, replica_blocks, text_of  # noqa: E402

MISSING = [m for m in ("jax", "flax") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.notebook, pytest.mark.jax, pytest.mark.timeout(600)]

TORCHAX = run_notebooks.NOTEBOOKS_DIR / "08-torchax.ipynb"
PROCESSES = 2
STEPS = 40
TIMEOUT = 240  # per cell
SESSION_CELLS = ("where", "model", "step", "train", "weights")  # the %%xla_spawn cells


@pytest.fixture(scope="module")
def torchax_nb(tmp_path_factory):
    if MISSING:  # (what the notebook says is still checked: the test that reads its source)
        pytest.skip(f"{' and '.join(MISSING)} not installed in this stack (torchax imports flax)")
    return run_notebooks.execute_notebook(TORCHAX, tmp_path_factory.mktemp("torchax"), TIMEOUT)[0]


def finished(text: str):
    """``{process: lines}`` of a run whose PROCESSES processes all finished."""
    assert re.search(rf"^{PROCESSES} replicas on CPU: {PROCESSES} done in \d+\.\d\d s"
                     r"( · results in `\w+`)?$",
                     text, re.M), text
    blocks = replica_blocks(text)
    assert sorted(blocks) == list(range(PROCESSES)), text
    for i, (heading, _) in blocks.items():
        assert re.fullmatch(rf"── replica {i} · done · \d+\.\d\d s", heading), heading
    return {i: lines for i, (_, lines) in blocks.items()}


def one_line(lines, pattern):
    """The match of the one line of ``lines`` that fully matches ``pattern``."""
    found = [m for m in (re.fullmatch(pattern, line) for line in lines) if m]
    assert len(found) == 1, (pattern, lines)
    return found[0]


def test_sizes_are_parameters_and_a_tpu_is_one_line_away():
    nb = nbformat.read(TORCHAX, as_version=4)  # (saved clean, with stable ids: test_tutorials)
    setup = cell(nb, "setup").source
    assert f"PROCESSES = {PROCESSES}" in setup and f"STEPS = {STEPS}" in setup, setup
    assert cell(nb, "start").source.strip() == "%xla_session start --runtime jax -n {PROCESSES}"
    for cell_id in SESSION_CELLS:  # they run on the session: no options of their own for that
        first = cell(nb, cell_id).source.splitlines()[0]
        assert first.startswith("%%xla_spawn"), (cell_id, first)
        assert not re.search(r" (-n|--runtime|--fresh)\b", first), (cell_id, first)
    told = cell(nb, "setup-md").source
    assert "**On a TPU host**, change one line" in told, told
    assert "becomes `%xla_session start --runtime jax` (no `-n`)" in told, told
    # nothing in the notebook's own cells calls JAX
    for c in nb.cells:
        if c.cell_type == "code" and not c.source.startswith("%%xla_spawn"):
            assert not re.search(r"\bjax\.(?!_src)|\bjnp\.|torchax", c.source), (c.id, c.source)


def test_runs_without_errors(torchax_nb):
    assert_every_cell_ran(torchax_nb)


def test_every_session_cell_runs_in_both_jax_processes_with_global_devices(torchax_nb):
    started = text_of(cell(torchax_nb, "start"))
    assert "colab_xla: JAX runtime, 2 processes on CPU with 1 device each" in started, started
    listed = {int(i): int(pid) for i, pid in
              re.findall(r"^  replica (\d+): pid (\d+), process \d+, memory ", started, re.M)}
    assert sorted(listed) == list(range(PROCESSES)) and len(set(listed.values())) == PROCESSES
    devices = {}
    for i, lines in finished(text_of(cell(torchax_nb, "where"))).items():
        m = one_line(lines, rf"process {i} of {PROCESSES}: pid (\d+), local devices \[(.+)\], "
                            r"global devices \[(.+)\]")
        assert int(m[1]) == listed[i], (i, m[0], listed)  # the session's process
        devices[i] = (m[2], m[3])
    local = [devices[i][0] for i in range(PROCESSES)]
    assert len(set(local)) == PROCESSES, devices  # each process its own device...
    assert {devices[i][1] for i in devices} == {devices[0][1]}, devices  # ...one global view
    assert devices[0][1] == ", ".join(local), devices
    for cell_id in SESSION_CELLS:
        finished(text_of(cell(torchax_nb, cell_id)))
    assert text_of(cell(torchax_nb, "stop")).splitlines() == ["colab_xla session: stopped."]


def test_each_process_holds_half_of_one_global_batch(torchax_nb):
    for i, lines in finished(text_of(cell(torchax_nb, "model"))).items():
        one_line(lines, rf"process {i}: local batch \(64, 8\) -> global batch \(128, 8\), "
                        r"weights 420 numbers")


def test_the_loss_is_the_same_in_both_processes_and_falls(torchax_nb):
    losses = {}
    for i, lines in finished(text_of(cell(torchax_nb, "train"))).items():
        m = one_line(lines, rf"process {i}: loss ([\d.]+) -> ([\d.]+) in {STEPS} steps")
        losses[i] = (float(m[1]), float(m[2]))
        assert "Pulled: losses (list)" in lines, lines
    assert losses[0] == losses[1], losses  # the global batch's loss, computed once for both
    first, last = losses[0]
    assert last < first / 2, losses
    shown = text_of(cell(torchax_nb, "losses")).splitlines()
    assert shown == [f"{{0: {last}, 1: {last}}}", "the same losses in both processes: True",
                     "loss fell: True"], shown


def test_the_final_weights_are_identical_in_both_processes_and_have_learned(torchax_nb):
    sums = {}
    for i, lines in finished(text_of(cell(torchax_nb, "weights"))).items():
        sums[i] = one_line(lines, rf"process {i}: weights sha256 ([0-9a-f]{{16}})")[1]
        assert "Pulled: weights (dict)" in lines, lines
    assert sums[0] == sums[1], sums
    shown = text_of(cell(torchax_nb, "compare")).splitlines()
    assert shown == ["processes: [0, 1]", f"sha256 of process 0's weights, here: {sums[0]}",
                     "identical in both processes: True", "changed by training: True"], shown
    shown = text_of(cell(torchax_nb, "evaluate")).strip()
    m = re.fullmatch(r"accuracy on new points: (\d\.\d\d) untrained, (\d\.\d\d) trained", shown)
    assert m, shown
    untrained, trained = float(m[1]), float(m[2])
    assert trained > 0.7 and trained > untrained + 0.3, shown


def test_the_notebooks_own_process_never_started_a_jax_backend(torchax_nb):
    shown = text_of(cell(torchax_nb, "backend")).splitlines()
    assert shown[-1] == "a JAX backend started in the notebook: False", shown
    assert re.fullmatch(r"jax imported in the notebook: (True|False)", shown[0]), shown
