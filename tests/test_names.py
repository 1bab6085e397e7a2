"""The notebook's names sent to replicas (colab_xla.wire.names): which, and which cannot be."""

import threading

import pytest

from colab_xla.wire import names
from colab_xla.wire.cell import Cell

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_used_names_are_the_notebook_names_the_cell_mentions_but_not_replica_names():
    ns = {"model": 1, "lr": 2, "index": 3, "device": 4, "unused": 5}
    source = "def step():\n    return model(lr)\nprint(index, device, undefined_here)"
    assert names.used_names(Cell(source), ns) == ["lr", "model"]


def test_names_that_cannot_be_sent_are_each_named_with_type_and_reason():
    ns = {"lk": threading.Lock(), "fine": [1, 2], "gen": (x for x in [])}
    with pytest.raises(names.UnsendableNames) as info:
        names.pack(["fine", "gen", "lk"], ns, "forkserver")
    failures = info.value.failures
    assert [(name, kind) for name, kind, _ in failures] == [("gen", "generator"), ("lk", "lock")]
    assert all(reason for _, _, reason in failures)
    assert "--start-method forkserver" in str(info.value) and "Fix:" in str(info.value)


def test_names_sent_together_keep_the_objects_they_share():
    shared = [1, 2]
    loaded = names.unpack(names.pack(["a", "b"], {"a": shared, "b": {"x": shared}}))
    assert loaded["a"] is loaded["b"]["x"]
