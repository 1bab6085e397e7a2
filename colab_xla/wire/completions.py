"""Tab completion of a session's replica names in the notebook: what a replica answers
(:func:`names`, :func:`typed`, :func:`answer`) and how the notebook reads it (:func:`read`).
IPython-free.

The notebook asks replica 0 for the names under one expression (``""``: its globals;
``"model.fc"``: that object's attributes) through a named pipe it made and reads with a
deadline; the replica answers from its command thread, between cells only (a replica
running a cell answers ``None``: busy), and never evaluates more than a dotted chain of
names (no calls, no indexing). Each name comes with its kind, as IPython's completions
type them (:func:`kind`: ``module``, ``class``, ``function``, ``property``, ``instance``),
read from what the replica holds without running a property.

>>> names("", {"model": 1, "_private": 2, "lr": 0.1})
['lr', 'model']
>>> names("x.real", {"x": 3})[:3]
['as_integer_ratio', 'bit_count', 'bit_length']
>>> names("x()", {"x": 3}) is None
True
>>> import os
>>> typed("", {"os": os, "f": print, "n": 1})
[['f', 'function'], ['n', 'instance'], ['os', 'module']]
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import json
import os
import re
import select
import time
from typing import List, Mapping, Optional

# The names one answer carries at most (an object with more: the first, sorted).
MOST = 2000
_CHAIN = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def is_chain(expr: str) -> bool:
    """Whether ``expr`` is a dotted chain of names (``model.fc``), all a question may be."""
    return bool(_CHAIN.match(expr))


def names(expr: str, namespace: Mapping[str, object]) -> Optional[List[str]]:
    """The names under ``expr`` in ``namespace``, sorted, without ``_`` ones: its keys
    (``expr`` empty), or the attributes of the object the dotted chain ``expr`` names.
    None if ``expr`` is not such a chain or does not resolve."""
    if not expr:
        found = list(namespace)
    elif not is_chain(expr):
        return None
    else:
        try:
            found = dir(_resolve(expr, namespace))
        except Exception:  # noqa: BLE001 - a name that is not there, a property that raises
            return None
    return sorted(n for n in found if isinstance(n, str) and not n.startswith("_"))[:MOST]


def typed(expr: str, namespace: Mapping[str, object]) -> Optional[List[List[str]]]:
    """:func:`names` with each one's :func:`kind`: ``[[name, kind], ...]``, or None."""
    found = names(expr, namespace)
    if found is None:
        return None
    if not expr:
        return [[name, kind(namespace[name])] for name in found]
    try:
        obj = _resolve(expr, namespace)
    except Exception:  # noqa: BLE001 - a property that raised this time
        return None
    held = vars(obj) if inspect.ismodule(obj) else None  # (a module's: a dict's look-up)
    return [[name, kind(held.get(name, _ABSENT) if held is not None
                        else inspect.getattr_static(obj, name, _ABSENT))] for name in found]


def kind(value: object) -> str:
    """What ``value`` is, as a completion's type: ``module``, ``class``, ``function`` (a
    function, method or builtin), ``property`` (an attribute a descriptor computes, read as
    it is stored on the class: never run), else ``instance``."""
    if inspect.ismodule(value):
        return "module"
    if inspect.isclass(value):
        return "class"
    if inspect.isroutine(value) or isinstance(value, (staticmethod, classmethod)):
        return "function"
    if isinstance(value, property) or inspect.isdatadescriptor(value):
        return "property"
    return "instance"


_ABSENT = object()  # (an attribute only __getattr__ gives: an object, as far as is known)


def _resolve(expr: str, namespace: Mapping[str, object]) -> object:
    first, *rest = expr.split(".")
    obj = namespace[first]
    for attr in rest:
        obj = getattr(obj, attr)
    return obj


def answer(path: str, expr: str, namespace: Optional[Mapping[str, object]],
           busy: bool) -> None:
    """In a replica: write the answer for ``expr`` to the notebook's pipe ``path`` (JSON:
    ``[[name, kind], ...]`` (:func:`typed`), or None when busy or unresolved). A notebook
    that stopped waiting (gone from the pipe) is not waited for."""
    result = None
    if not busy and namespace is not None:
        with contextlib.suppress(RuntimeError):  # (changed while read: a thread of a cell)
            result = typed(expr, dict(namespace))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: nobody reads any more
    except OSError:
        return
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        os.write(fd, json.dumps(result).encode() + b"\n")
    except OSError:  # (the notebook gave up meanwhile)
        pass
    finally:
        os.close(fd)


def read(fd: int, deadline: float) -> Optional[List[List[str]]]:
    """In the notebook: the answer on ``fd`` (the pipe, opened read-write and non-blocking
    before the question was sent: so the replica's open finds a reader, and a read waits
    for the answer's end, a newline, not for a writer), read until ``deadline``
    (monotonic): ``[[name, kind], ...]``; None if it did not come whole in time, or was
    None."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        with contextlib.suppress(BlockingIOError):
            data += os.read(fd, 1 << 16)
    try:
        result = json.loads(data)
    except ValueError:
        return None
    if not isinstance(result, list):
        return None
    return [item for item in result if isinstance(item, list) and len(item) == 2
            and all(isinstance(part, str) for part in item)]
