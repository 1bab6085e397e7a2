"""The names of cells and runs (colab_xla.wire.ids): a count and this process's token."""

import os
import re

import pytest

from colab_xla.wire.cell import Cell, CellModule

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_names_differ_from_cell_to_cell_and_from_a_forked_process_without_a_new_token(
        tmp_path):
    """A cell's module name and a run's id are a count and this process's token (drawn
    once: see colab_xla.wire.ids); a process forked from this one draws its own."""
    from colab_xla.wire import ids

    first = CellModule.create(Cell("x = 1\n"), str(tmp_path))
    second = CellModule.create(Cell("x = 1\n"), str(tmp_path))
    assert first.name != second.name
    assert first.name.endswith("_" + ids.token()) and second.name.endswith("_" + ids.token())
    assert re.fullmatch(r"[0-9a-f]{8}", ids.token())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its token, to the parent
        try:
            os.write(w, ids.token().encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        child = os.read(r, 64).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert re.fullmatch(r"[0-9a-f]{8}", child) and child != ids.token()
