"""A replica's execution of a cell without XLA (colab_xla.replica.execution): its
traceback, its globals."""

import sys

import pytest

from colab_xla.replica import execution as replica_execution
from colab_xla.wire.cell import Cell, CellModule

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_traceback_starts_at_the_cell_and_names_its_lines(tmp_path):
    cell = CellModule.create(Cell("def f():\n    raise KeyError('k')\nr = f()\n",
                                  label="Cell In[9]"), str(tmp_path))
    try:
        exec(cell.body, {})
    except KeyError as exc:
        error = replica_execution.error_from_exception(exc, cell)
    assert (error.kind, error.ename, error.evalue) == ("exception", "KeyError", "'k'")
    assert "Cell In[9], line 4, in <module>" in error.traceback
    assert "Cell In[9], line 3, in f" in error.traceback
    assert cell.path not in error.traceback and "test_execution.py" not in error.traceback


def test_replica_globals_resolve_device_only_when_used(monkeypatch):
    import types

    calls = []
    fake = types.SimpleNamespace(device=lambda: calls.append(1) or "xla:7",
                                 _XLAC=types.SimpleNamespace(  # (no client recorded here)
                                     _xla_runtime_is_initialized=lambda: False))
    monkeypatch.setitem(sys.modules, "torch_xla", fake)
    ns = replica_execution.ReplicaGlobals(x=1)
    exec("y = x + 1", ns)
    assert calls == [] and "device" not in ns
    exec("d = device\nd2 = device", ns)
    assert ns["d"] == ns["d2"] == "xla:7" and calls == [1]
    with pytest.raises(NameError):
        exec("undefined_name", ns)
