"""Names bound before a replacement (colab_xla.runtimes.bound_names): every one gets it."""

import sys
import types

import cloudpickle
import pytest

from colab_xla.runtimes import bound_names
from colab_xla.runtimes.bound_names import Bindings, rebind

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


@pytest.mark.parametrize("found_before", [False, True], ids=["read", "found before"])
def test_every_name_bound_to_a_replaced_function_gets_the_replacement(monkeypatch, tmp_path,
                                                                      found_before):
    def original():
        return "original"

    def replacement():
        return "replacement"

    library = types.ModuleType("a_library")  # (its function serialized by reference)
    original.__module__, original.__qualname__ = "a_library", "call"
    library.call = original
    monkeypatch.setitem(sys.modules, "a_library", library)
    helpers = types.ModuleType("helpers")  # the user's own module: ``from a_library import call``
    helpers.__file__, helpers.call = str(tmp_path / "helpers.py"), original
    monkeypatch.setitem(sys.modules, "helpers", helpers)
    ns = {"call": original}  # (a name the notebook bound: ``from a_library import call``)
    exec("def caller():\n    return call()\n"
         "class Holder:\n    @staticmethod\n    def use():\n        return call()\n", ns)
    # Functions that came serialized have globals of their own, not ``ns``.
    names = {"call": original, **{name: cloudpickle.loads(cloudpickle.dumps(ns[name]))
                                  for name in ("caller", "Holder")}}
    # (found before: as the notebook finds them before it forks, for a forked replica)
    found = Bindings.find(["a_library"], names) if found_before else None
    rebind({original: replacement}, names, found)
    assert library.call is replacement and names["call"] is replacement
    assert helpers.call is replacement
    assert names["caller"]() == names["Holder"].use() == "replacement"
    assert ns["caller"]() == "original"  # (``ns`` is no namespace of the replica's)


def test_a_function_not_found_before_is_rebound_by_reading_every_namespace(monkeypatch):
    # Found before the fork: the functions of the modules imported then. Another (of a
    # module the replica imported after) is looked for the way a spawned replica does.
    def original():
        return "original"

    library = types.ModuleType("a_library_imported_later")
    original.__module__, library.call = "a_library_imported_later", original
    found = Bindings.find(["a_library_imported_later"], {})  # (not imported yet)
    monkeypatch.setitem(sys.modules, "a_library_imported_later", library)
    names = {"call": original}
    assert not found.covers(original)
    rebind({original: len}, names, found)
    assert library.call is len and names["call"] is len


def test_a_name_bound_again_after_the_search_keeps_its_new_value():
    def original():
        return "original"

    def own():
        return "the cell's own"

    library = types.ModuleType("a_library_found")
    original.__module__, library.call = "a_library_found", original
    names = {"call": original}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "a_library_found", library)
        found = Bindings.find(["a_library_found"], names)
    names["call"] = own  # (rebound between the search and the replacement)
    rebind({original: len}, names, found)
    assert names["call"] is own and library.call is len


def test_a_module_imported_since_the_last_search_is_read(monkeypatch, tmp_path):
    # The user's modules are found once and kept while sys.modules stays as it was.
    def original():
        return "original"

    original.__module__ = "a_library_kept"
    library = types.ModuleType("a_library_kept")
    library.call = original
    monkeypatch.setitem(sys.modules, "a_library_kept", library)
    Bindings.find(["a_library_kept"], {})  # (the user's modules, as they are now)
    helpers = types.ModuleType("helpers_imported_since")  # ``from a_library import call``
    helpers.__file__, helpers.call = str(tmp_path / "helpers_imported_since.py"), original
    monkeypatch.setitem(sys.modules, "helpers_imported_since", helpers)
    rebind({original: len}, {}, Bindings.find(["a_library_kept"], {}))
    assert helpers.call is len


def test_only_the_modules_imported_since_the_last_search_are_read_unless_one_was_removed(
        monkeypatch, tmp_path):
    # Reading a module writes to its pages; a forked replica reads only what it imported.
    read = []
    real = bound_names._outside
    monkeypatch.setattr(bound_names, "_outside",
                        lambda module, libraries: read.append(module)
                        or real(module, libraries))
    bound_names.own_modules()
    read.clear()
    mine = types.ModuleType("mine_imported_since")
    mine.__file__ = str(tmp_path / "mine_imported_since.py")
    monkeypatch.setitem(sys.modules, "mine_imported_since", mine)
    assert mine in bound_names.own_modules() and read == [mine]
    read.clear()
    assert mine in bound_names.own_modules() and read == []  # (nothing imported since)
    monkeypatch.delitem(sys.modules, "mine_imported_since")
    other = types.ModuleType("other_imported_since")
    other.__file__ = str(tmp_path / "other_imported_since.py")
    monkeypatch.setitem(sys.modules, "other_imported_since", other)
    found = bound_names.own_modules()
    assert other in found and mine not in found
    everything = [module for name, module in sys.modules.items() if name != "__main__"]
    assert list(map(id, read)) == list(map(id, everything))  # (__main__ is the user's, unread)
