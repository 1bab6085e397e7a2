"""Tab completion of a session's replica names in the notebook: what a replica answers
(:func:`names`, :func:`answer`) and how the notebook reads it (:func:`read`). IPython-free.

The notebook asks replica 0 for the names under one expression (``""``: its globals;
``"model.fc"``: that object's attributes) through a named pipe it made and reads with a
deadline; the replica answers from its command thread, between cells only (a replica
running a cell answers ``None``: busy), and never evaluates more than a dotted chain of
names (no calls, no indexing).

>>> names("", {"model": 1, "_private": 2, "lr": 0.1})
['lr', 'model']
>>> names("x.real", {"x": 3})[:3]
['as_integer_ratio', 'bit_count', 'bit_length']
>>> names("x()", {"x": 3}) is None
True
"""

from __future__ import annotations

import contextlib
import fcntl
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
        first, *rest = expr.split(".")
        try:
            obj = namespace[first]
            for attr in rest:
                obj = getattr(obj, attr)
            found = dir(obj)
        except Exception:  # noqa: BLE001 - a name that is not there, a property that raises
            return None
    return sorted(n for n in found if isinstance(n, str) and not n.startswith("_"))[:MOST]


def answer(path: str, expr: str, namespace: Optional[Mapping[str, object]],
           busy: bool) -> None:
    """In a replica: write the answer for ``expr`` to the notebook's pipe ``path`` (JSON:
    a list of names, or None when busy or unresolved). A notebook that stopped waiting
    (gone from the pipe) is not waited for."""
    result = None
    if not busy and namespace is not None:
        with contextlib.suppress(RuntimeError):  # (changed while read: a thread of a cell)
            result = names(expr, dict(namespace))
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


def read(fd: int, deadline: float) -> Optional[List[str]]:
    """In the notebook: the answer on ``fd`` (the pipe, opened read-write and non-blocking
    before the question was sent: so the replica's open finds a reader, and a read waits
    for the answer's end, a newline, not for a writer), read until ``deadline``
    (monotonic); None if it did not come whole in time, or was None."""
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
    return result if isinstance(result, list) else None
