"""Tutorial 09 (DDP on 4 torch.distributed processes, ``--runtime torch``) in a real kernel.

The notebook runs once (module fixture) through ``run_notebooks.execute_notebook``: every
cell ran; each process says its RANK, WORLD_SIZE, LOCAL_RANK, the gloo backend and the CPU;
the loss, averaged across the ranks, is the same on every rank and falls; the weights pulled
from the ranks are identical (the notebook says so); the GPU variant is one line.
"""

from __future__ import annotations

import re

import pytest

import run_notebooks  # tools/ is on sys.path (conftest.py)
from test_notebooks import assert_every_cell_ran, cell, replica_blocks, text_of  # noqa: E402

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(600)]

DDP = run_notebooks.NOTEBOOKS_DIR / "09-ddp-torch.ipynb"
RANKS = 4


@pytest.fixture(scope="module")
def ddp_nb(tmp_path_factory):
    return run_notebooks.execute_notebook(DDP, tmp_path_factory.mktemp("ddp"), 240)[0]


def test_every_cell_runs(ddp_nb):
    assert_every_cell_ran(ddp_nb)


def test_each_process_has_its_rank_the_group_and_the_cpu(ddp_nb):
    blocks = replica_blocks(text_of(cell(ddp_nb, "ranks")))
    assert sorted(blocks) == list(range(RANKS))
    for rank, (_, lines) in blocks.items():
        assert (f"RANK {rank} of WORLD_SIZE {RANKS}, LOCAL_RANK {rank}, backend gloo, "
                "device cpu") in lines, lines


def test_the_averaged_loss_is_every_ranks_and_falls(ddp_nb):
    blocks = replica_blocks(text_of(cell(ddp_nb, "train")))
    losses = {rank: [float(m.group(1)) for m in map(
        re.compile(r"step \d+: loss ([\d.]+)").fullmatch, lines) if m]
        for rank, (_, lines) in blocks.items()}
    assert sorted(losses) == list(range(RANKS)) and len(losses[0]) == 4, losses
    assert all(seen == losses[0] for seen in losses.values()), losses
    assert losses[0][-1] < losses[0][0] / 10, losses[0]


def test_the_ranks_weights_are_identical(ddp_nb):
    said = text_of(cell(ddp_nb, "compare"))
    assert re.fullmatch(rf"{RANKS} ranks, \d+ weights each, identical: True\n", said), said
    sums = {lines[0] for _, (_, lines) in replica_blocks(text_of(cell(ddp_nb, "weights"))).items()}
    assert len(sums) == 1 and sums.pop().startswith("checksum "), sums


def test_the_tpu_and_gpu_variant_is_one_line():
    import nbformat

    nb = nbformat.read(DDP, as_version=4)
    assert "".join(cell(nb, "start").source) == "%xla_session start --runtime torch -n {RANKS}"
    intro = "".join(nb.cells[0].source)
    assert "becomes `%xla_session start --runtime torch`" in intro
    assert "TorchTPU" in intro and "CUDA GPUs" in intro
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # saved clean
