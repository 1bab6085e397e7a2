"""Tutorial 05 (state back, start methods, --debug-single, --env, --cache) in a real kernel.

The kernel's ``__main__`` is IPython's user module there, so this is where classes and
functions of a notebook are checked to travel both ways: by reference under fork, by value
to a forkserver replica and back as the notebook's own class.
"""

from __future__ import annotations

import re

import nbformat
import pytest

import run_notebooks  # tools/ is on sys.path (conftest.py)
from test_notebooks import assert_every_cell_ran, cell, replica_blocks, text_of  # noqa: E402

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(600), pytest.mark.stacks("colab")]

STATE = run_notebooks.NOTEBOOKS_DIR / "05-state-and-start-methods.ipynb"
REPLICAS = 4


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return run_notebooks.execute_notebook(STATE, tmp_path_factory.mktemp("state"), 240)[0]


def test_saved_clean_and_only_the_tagged_cell_raises(state):
    saved = nbformat.read(STATE, as_version=4)
    assert all(c.outputs == [] for c in saved.cells if c.cell_type == "code")
    assert [c.id for c in saved.cells if "raises-exception" in c.metadata.get("tags", [])] \
        == ["unsendable-run"]
    # A UsageError fails the cell (Run All stops there) but is shown as text, not as an
    # error output: every cell ran, and none has an error output.
    assert_every_cell_ran(state)


def test_the_model_trained_in_the_replicas_is_the_notebooks_class_on_cpu(state):
    blocks = replica_blocks(text_of(cell(state, "train")))
    assert sorted(blocks) == list(range(REPLICAS))
    assert "Pulled: model (Net)" in blocks[0][1]  # --pull-from 0: only replica 0 sends it
    assert all(not any(line.startswith("Pulled") for line in blocks[o][1]) for o in (1, 2, 3))
    used = text_of(cell(state, "use")).splitlines()
    assert used[0] == "Net is the notebook's Net: True"
    assert used[1] == "weights on: cpu"
    assert used[2] == "learned: [3.0, -2.0] 1.0"  # y = 3 x0 - 2 x1 + 1, from all replicas
    assert re.fullmatch(r"last loss per replica: \{0: [\d.]+, 1: [\d.]+, 2: [\d.]+, 3: [\d.]+\}",
                        used[3])
    assert used[4] == "every replica's last loss below 0.1: True"


def test_forkserver_replicas_use_notebook_names_and_run_outside_the_notebook(state):
    first = text_of(cell(state, "forkserver"))
    assert "starting the forkserver" in first
    pids = set()
    for o, (_, lines) in replica_blocks(first).items():
        m = re.fullmatch(rf"replica {o} in process (\d+), parent (\d+): \({8 + o}, 2\)", lines[0])
        assert m, lines
        pids.add(m.groups())
        assert lines[1] == f"Out: ({8 + o}, 'Net')"
    assert len(pids) == REPLICAS  # CPU: a process per replica
    (parent,), = {(parent,) for _, parent in pids}  # all forked by the forkserver
    notebook_pid = re.search(r"the notebook's pid: (\d+)", text_of(cell(state, "forkserver-check")))
    assert notebook_pid.group(1) != parent  # forked by the server, not the kernel
    assert "sizes: {0: (8, 'Net'), 1: (9, 'Net'), 2: (10, 'Net'), 3: (11, 'Net')}" in \
        text_of(cell(state, "forkserver-check"))
    again = text_of(cell(state, "forkserver-again"))
    assert "starting the forkserver" not in again  # warm: started once per notebook
    assert f"{REPLICAS} replicas on CPU: {REPLICAS} done" in again


def test_a_name_that_cannot_be_sent_is_named_and_nothing_runs(state):
    shown = text_of(cell(state, "unsendable-run"))
    assert re.search(r"^UsageError: --start-method forkserver .* guard \(lock\): TypeError",
                     shown, re.M)
    assert "Fix: Create the object inside the cell, or use --start-method fork" in shown
    assert "── replica" not in shown


def test_debug_single_runs_replica_zero_alone_with_the_replicas_environment(state):
    shown = text_of(cell(state, "debug"))
    assert "1 replica on CPU: 1 done" in shown and "--debug-single runs one replica" in shown
    assert "replica 0 of 1, XLA_IR_DEBUG=1, RUN_NAME=try-3" in shown
    assert "RUN_NAME in the notebook: None" in text_of(cell(state, "debug-check"))


def test_the_cache_is_set_up_and_a_rerun_tries_it(state):
    first, rerun = text_of(cell(state, "cache-run")), text_of(cell(state, "cache-rerun"))
    for shown in (first, rerun):
        blocks = replica_blocks(shown)
        assert {o: blocks[o][1][-1] for o in blocks} == {o: f"Out: {6.0 * o}" for o in range(4)}
    # What the tutorial tells its reader the rerun says on CPU (XLA's words, which the
    # tutorial quotes): the test checks the tutorial, not XLA.
    told = re.search(r"the rerun says\s+`([^`]+)`",
                     "".join(c.source for c in nbformat.read(STATE, as_version=4).cells
                             if c.cell_type == "markdown"))
    assert told, "tutorial 05 no longer quotes what a rerun with --cache says on CPU"
    assert told.group(1) not in first
    assert told.group(1) in rerun  # CPU: tried, cannot
    held = text_of(cell(state, "cache-check")).splitlines()  # a process per replica
    assert [line.split()[0] for line in held] == [f"process-{o}" for o in range(REPLICAS)], held
    assert all(re.fullmatch(r"process-\d holds [1-9]\d* compiled program\(s\)", h) for h in held)
