"""A library's function replaced in a replica process under every name bound to it.

A runtime replaces some of a library's functions in each replica process
(``torch.distributed.init_process_group``: :mod:`colab_xla.runtimes.torch`; torch_xla's
collectives in the simulation: :mod:`colab_xla.runtimes.torch_xla_process`), after the
process forked from the notebook or loaded the notebook's names. Setting the library's
attribute alone would reach an alias of the module (``import torch.distributed as dist``)
but not a name bound to the function itself before, as a notebook cell's ``from
torch.distributed import init_process_group`` binds it. :func:`rebind` gives the
replacement to every name bound to the original in the namespaces a cell reaches: the
globals of the user's own modules (the notebook's ``__main__``, those of the user's files;
not those installed with Python, in site-packages or colab_xla's), of the original's own
module and the packages above it, the notebook's names as the replica has them, and the
globals of the functions and classes among them (those that came serialized have globals
of their own). Names are rebound, not objects: a function kept in a closure, a default
argument, a container or an installed package's module is not reached.

A forked replica reading those namespaces would copy their pages (each read writes a
reference count): the notebook's process finds the names before it forks
(:meth:`Bindings.find`, carried by :func:`colab_xla.replica.process.inherit`), and a
forked replica's :func:`rebind` reads what was found instead.

Example::

    >>> def original(): return "torch's"
    >>> def replacement(): return "colab_xla's"
    >>> names = {"init": original}
    >>> rebind({original: replacement}, names)
    >>> names["init"]()
    "colab_xla's"
"""

from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple


class Bindings:
    """Where names are bound to some functions (every function of some modules), found
    once: in the notebook's process before it forks, for the replicas it forks."""

    def __init__(self, functions: Iterable[Callable], names: Dict[str, Any]):
        self._functions = {id(function): function for function in functions}
        self._places: Dict[int, List[Tuple[dict, str]]] = {}
        if not self._functions:
            return
        for namespace in _namespaces(names, self._functions.values()):
            for name, value in _bound(namespace, self._functions):
                self._places.setdefault(id(value), []).append((namespace, name))

    @classmethod
    def find(cls, modules: Iterable[str], names: Dict[str, Any]) -> "Bindings":
        """The bindings of every function of ``modules`` (those imported: a module
        imported after the fork binds the replacement) in the namespaces a cell reaches,
        ``names`` (the notebook's) among them."""
        functions = [value for module in modules if module in sys.modules
                     for value in list(vars(sys.modules[module]).values())
                     if isinstance(value, types.FunctionType)]
        return cls(functions, names)

    def covers(self, original: Callable) -> bool:
        """Whether ``original`` was looked for (its bindings are these)."""
        return self._functions.get(id(original)) is original

    def rebind(self, original: Callable, new: Callable) -> None:
        """``new`` under every name found bound to ``original`` and still bound to it."""
        for namespace, name in self._places.get(id(original), ()):
            if namespace.get(name) is original:
                namespace[name] = new


def rebind(replacements: Mapping[Callable, Callable], names: Dict[str, Any],
           found: Optional[Bindings] = None) -> None:
    """Every name bound to a key of ``replacements`` (an original function) bound to its
    value (the replacement) instead, in the namespaces a cell reaches (above), ``names``
    (the notebook's names, as the replica has them) among them: where ``found`` (the
    names found before the fork) says, for the originals it covers; by reading those
    namespaces for the rest."""
    rest = {}
    for original, new in replacements.items():
        if found is not None and found.covers(original):
            found.rebind(original, new)
        else:
            rest[original] = new
    if not rest:
        return
    originals = {id(original): original for original in rest}
    for namespace in _namespaces(names, rest):
        for name, value in _bound(namespace, originals):
            namespace[name] = rest[value]


_NONE = object()  # (no function: not even None)


def _bound(namespace: dict, functions: Mapping[int, Callable]) -> List[Tuple[str, Any]]:
    """The names of ``namespace`` bound to one of ``functions`` (by id), with it."""
    # (a C loop first: most namespaces bind none)
    if functions.keys().isdisjoint(map(id, namespace.values())):
        return []
    return [(name, value) for name, value in list(namespace.items())
            if functions.get(id(value), _NONE) is value]


def _namespaces(names: Dict[str, Any], originals) -> Iterator[dict]:
    """The namespaces a cell reaches, each once: the modules of the user's own files (not
    those installed with Python or in its site-packages, nor colab_xla's), the originals'
    own modules and the packages above them, the notebook's names and their functions'
    globals."""
    seen: Dict[int, dict] = {}
    modules = own_modules()
    # the originals' own modules and the packages above them (torch.distributed)
    for home in {getattr(original, "__module__", None) or "" for original in originals}:
        parts = home.split(".")
        modules += [sys.modules.get(".".join(parts[:n])) for n in range(1, len(parts) + 1)]
    for module in modules:
        try:
            namespace = vars(module)
        except Exception:  # noqa: BLE001 - None (a blocked import), or an odd stand-in
            continue
        if isinstance(namespace, dict):
            seen.setdefault(id(namespace), namespace)
    seen.setdefault(id(names), names)
    for value in list(names.values()):
        for function in _functions(value):
            seen.setdefault(id(function.__globals__), function.__globals__)
    return iter(list(seen.values()))


# The user's own modules as last found, with what sys.modules was then (its size and its
# newest module): for reading every module writes to the pages of all of them, which a
# fork made copy-on-write, only the modules imported since are read, and all of them again
# only when one was removed. (Not seen: a module put in place of another under an older
# name, which no import does.)
_own: Optional[Tuple[tuple, list]] = None


def own_modules() -> list:
    """The modules of the process that are the user's own: ``__main__``, and those of a
    file outside Python's own, the installed packages' and colab_xla's (which binds no
    original: its modules are as installed, whether or not pip copied them)."""
    global _own
    modules = sys.modules
    (size, newest, ident), own = _own or ((0, None, None), [])
    now = _state(modules)
    if (size, newest, ident) == now:
        return list(own)
    added = _imported_since(modules, newest, ident)
    if added is None or len(modules) != size + len(added):  # one was removed: read all
        added, own = list(modules), []
    libraries = _library_paths()
    own = own + [modules[name] for name in added
                 if name == "__main__" or _outside(modules[name], libraries)]
    _own = (now, own)
    return list(own)


def _state(modules: dict) -> tuple:
    newest = next(reversed(modules), None)
    return len(modules), newest, id(modules.get(newest))


def _imported_since(modules: dict, newest: Optional[str], ident: Optional[int]
                    ) -> Optional[List[str]]:
    """The names of the modules imported after ``newest`` (whose module's id was
    ``ident``), oldest first; None if it is no longer there."""
    if newest is None or id(modules.get(newest)) != ident:
        return None
    added = []
    try:
        for name in reversed(modules):
            if name == newest:
                return added[::-1]
            added.append(name)
    except RuntimeError:  # (another thread imported meanwhile)
        pass
    return None


def _outside(module, libraries: tuple) -> bool:
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and not file.startswith(libraries)


@functools.lru_cache(maxsize=None)
def _library_paths() -> tuple:
    """Where Python's own modules, the installed packages and colab_xla are."""
    import sysconfig

    paths = sysconfig.get_paths()
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return tuple(os.path.join(path, "") for path in
                 [paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
                 + [package] if path)


def _functions(value: Any) -> Iterator[types.FunctionType]:
    """``value`` if it is a function; a class's own functions (its methods, static and
    class methods)."""
    if isinstance(value, types.FunctionType):
        yield value
    elif isinstance(value, type):
        for member in list(vars(value).values()):
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, types.FunctionType):
                yield member
