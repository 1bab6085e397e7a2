"""A library's function replaced in a replica process under every name bound to it.

A runtime replaces some of a library's functions in each replica process
(``torch.distributed.init_process_group``: :mod:`colab_xla.runtimes.torch`; torch_xla's
collectives in the simulation: :mod:`colab_xla.runtimes.torch_xla_process`), after the
process forked from the notebook or loaded the notebook's names. Setting the library's
attribute alone would reach an alias of the module (``import torch.distributed as dist``)
but not a name bound to the function itself before, as a notebook cell's ``from
torch.distributed import init_process_group`` binds it. :func:`rebind` gives the
replacement to every name bound to the original in the namespaces a cell reaches: the
globals of every module (the library's own, the notebook's ``__main__``, the modules it
imported), the notebook's names as the replica has them, and the globals of the functions
and classes among them (those that came serialized have globals of their own). Names are
rebound, not objects: a function kept in a closure, a default argument or a container is
not reached.

Example::

    >>> def original(): return "torch's"
    >>> def replacement(): return "colab_xla's"
    >>> names = {"init": original}
    >>> rebind({original: replacement}, names)
    >>> names["init"]()
    "colab_xla's"
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any, Callable, Dict, Iterator, Mapping


def rebind(replacements: Mapping[Callable, Callable], names: Dict[str, Any]) -> None:
    """Every name bound to a key of ``replacements`` (an original function) bound to its
    value (the replacement) instead, in every module's globals, in ``names`` (the notebook's
    names, as the replica has them) and in the globals of the functions and classes among
    ``names``."""
    by_id = {id(original): (original, new) for original, new in replacements.items()}
    for namespace in _namespaces(names, replacements):
        # (a C loop first: of a process's thousand modules, a few bind an original)
        if by_id.keys().isdisjoint(map(id, namespace.values())):
            continue
        for name, value in list(namespace.items()):
            found = by_id.get(id(value))
            if found is not None and found[0] is value:
                namespace[name] = found[1]


def _namespaces(names: Dict[str, Any], originals) -> Iterator[dict]:
    """The namespaces a cell reaches, each once: every module but those installed with
    Python or in its site-packages (a library's own; reading them all cost a forked replica
    a copy of their pages), the originals' own modules and the packages above them, the
    notebook's names and their functions' globals."""
    seen: Dict[int, dict] = {}
    libraries = _library_paths()
    modules = [module for module in list(sys.modules.values())
               if not _installed(module, libraries)]
    for original in originals:  # its module and the packages above it (torch.distributed)
        parts = (getattr(original, "__module__", None) or "").split(".")
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


def _library_paths() -> tuple:
    """Where Python's own modules and installed packages are."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(os.path.join(paths[key], "") for key in ("stdlib", "platstdlib", "purelib",
                                                           "platlib") if paths.get(key))


def _installed(module, libraries: tuple) -> bool:
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and file.startswith(libraries)


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
