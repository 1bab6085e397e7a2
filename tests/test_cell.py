"""A cell as the replicas run it (colab_xla.wire.cell): its module file, its lines, its
result, its refusals, and the module pickled to a replica."""

import os
import pickle
import stat

import pytest

from colab_xla.wire.cell import Cell, CellModule, EmptyCellError

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_cell_is_written_as_a_private_module_with_a_unique_name(tmp_path):
    a = CellModule.create(Cell("x = 1\n", label="Cell In[1]"), str(tmp_path))
    b = CellModule.create(Cell("x = 1\n", label="Cell In[1]"), str(tmp_path))
    assert a.name != b.name and a.name.isidentifier()
    assert os.path.dirname(a.path) == str(tmp_path)
    assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o600
    assert open(a.path).read() == "# %%xla_spawn\nx = 1\n"


def test_a_cells_name_differs_from_a_forked_processs_next_one(tmp_path):
    """A process forked from this one counts its cells from the same number: its names
    still differ from this process's (their random part)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next cell's name, to the parent
        try:
            os.write(w, CellModule.create(Cell("x = 1\n"), str(tmp_path)).name.encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        child = os.read(r, 256).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    ours = CellModule.create(Cell("x = 1\n"), str(tmp_path)).name
    assert child.startswith("xla_cell_") and child != ours


def test_cell_line_numbers_are_the_notebook_lines(tmp_path):
    # Line 1 of the notebook cell is the magic line, so the body starts at line 2.
    cell = CellModule.create(Cell("a = 1\nb = 2\nc = 1 / 0\n"), str(tmp_path))
    with pytest.raises(ZeroDivisionError) as info:
        exec(cell.body, {})
    assert info.tb.tb_next.tb_lineno == 4
    assert info.tb.tb_next.tb_frame.f_code.co_filename == cell.path


def test_a_cell_without_a_magic_line_is_numbered_from_its_own_first_line(tmp_path):
    """Auto mode's cells: the person wrote no %%xla_spawn line, so none is in the module
    (pdb lists it) and the cell's lines are the module's, also once it travels to a
    replica, marshalled or compiled again from its file by another Python."""
    cell = CellModule.create(Cell("a = 1\nc = 1 / 0\n", header=None), str(tmp_path))
    assert open(cell.path).read() == "a = 1\nc = 1 / 0\n"
    assert cell.lines == ["a = 1", "c = 1 / 0"]
    loader, args = cell.__reduce__()
    for module in (pickle.loads(pickle.dumps(cell)),
                   loader(*args[:3], b"\x00\x00\r\n", *args[4:])):  # (another Python's)
        assert module.source == "a = 1\nc = 1 / 0\n" and module.lines == cell.lines
        with pytest.raises(ZeroDivisionError) as info:
            exec(module.body, {})
        assert info.tb.tb_next.tb_lineno == 2
    with pytest.raises(SyntaxError) as info:
        Cell("x = 1\ny = (\n", header=None).check()
    assert info.value.lineno == 2


def test_last_expression_is_the_result_and_semicolon_hides_it(tmp_path):
    cell = CellModule.create(Cell("x = 6\nx * 7\n"), str(tmp_path))
    ns = {}
    exec(cell.body, ns)
    assert eval(cell.last_expr, ns) == 42
    hidden = CellModule.create(Cell("x = 6\nx * 7;  # no result\n"), str(tmp_path))
    assert hidden.last_expr is None
    assert CellModule.create(Cell("x = 6\n"), str(tmp_path)).last_expr is None


@pytest.mark.parametrize("source", ["", "   \n\n", "# just a comment\n"])
def test_empty_cell_is_refused(tmp_path, source):
    with pytest.raises(EmptyCellError):
        CellModule.create(Cell(source), str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_syntax_error_names_the_cell_and_its_line(tmp_path):
    with pytest.raises(SyntaxError) as info:
        CellModule.create(Cell("x = 1\ny = (\n", label="Cell In[3]"), str(tmp_path))
    assert info.value.filename == "Cell In[3]"
    assert info.value.lineno == 3


def test_a_pickled_cell_module_brings_its_code_and_reads_its_file_only_on_another_python(
        tmp_path):
    # A session's replicas get every cell pickled: they run the code the notebook compiled
    # (marshalled), not the file read, parsed and compiled again by each of them.
    cell = CellModule.create(Cell("x = 6\nx * 7\n", label="Cell In[2]"), str(tmp_path))
    loader, args = cell.__reduce__()
    with open(cell.path, "w") as f:  # (what the file says now tells which path was taken)
        f.write("# %%xla_spawn\nx = 5\nx * 7\n")
    loaded = pickle.loads(pickle.dumps(cell))
    assert (loaded.name, loaded.path, loaded.label, loaded.source) == (
        cell.name, cell.path, "Cell In[2]", "x = 6\nx * 7\n")
    ns = {}
    exec(loaded.body, ns)
    assert eval(loaded.last_expr, ns) == 42 and loaded.body.co_filename == cell.path
    # Marshalled by another Python (its magic number): compiled from the file instead.
    other = loader(*args[:3], b"\x00\x00\r\n", args[4])
    ns = {}
    exec(other.body, ns)
    assert eval(other.last_expr, ns) == 35 and other.source == "x = 5\nx * 7\n"


def test_a_file_planted_at_the_module_path_is_never_written_through(tmp_path, monkeypatch):
    import itertools

    monkeypatch.setattr("colab_xla.wire.cell._counter", itertools.count(1))
    monkeypatch.setattr("colab_xla.wire.cell.token_hex", lambda n: "feed")
    target = tmp_path / "victim"
    target.write_text("untouched")
    (tmp_path / "xla_cell_1_feed.py").symlink_to(target)
    with pytest.raises(FileExistsError):
        CellModule.create(Cell("x = 1\n"), str(tmp_path))
    assert target.read_text() == "untouched"


def test_a_cell_module_pickles_as_its_file_and_compiles_again(tmp_path):
    cell = CellModule.create(Cell("y = 6\ny * 7\n", label="Cell In[3]"), str(tmp_path))
    again = pickle.loads(pickle.dumps(cell))
    assert (again.name, again.path, again.label, again.source) == \
        (cell.name, cell.path, cell.label, cell.source)
    ns = {}
    exec(again.body, ns)
    assert eval(again.last_expr, ns) == 42
