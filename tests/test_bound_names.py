"""Names bound before a replacement (colab_xla.runtimes.bound_names): every one gets it."""

import sys
import types

import cloudpickle
import pytest

from colab_xla.runtimes.bound_names import rebind

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_every_name_bound_to_a_replaced_function_gets_the_replacement(monkeypatch):
    def original():
        return "original"

    def replacement():
        return "replacement"

    library = types.ModuleType("a_library")  # (its function serialized by reference)
    original.__module__, original.__qualname__ = "a_library", "call"
    library.call = original
    monkeypatch.setitem(sys.modules, "a_library", library)
    ns = {"call": original}  # (a name the notebook bound: ``from a_library import call``)
    exec("def caller():\n    return call()\n"
         "class Holder:\n    @staticmethod\n    def use():\n        return call()\n", ns)
    # Functions that came serialized have globals of their own, not ``ns``.
    names = {"call": original, **{name: cloudpickle.loads(cloudpickle.dumps(ns[name]))
                                  for name in ("caller", "Holder")}}
    rebind({original: replacement}, names)
    assert library.call is replacement and names["call"] is replacement
    assert names["caller"]() == names["Holder"].use() == "replacement"
    assert ns["caller"]() == "original"  # (``ns`` is no namespace of the replica's)
