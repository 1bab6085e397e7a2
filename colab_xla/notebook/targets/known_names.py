"""Which notebook names warm replicas have (a session's, here or on every host of a
cluster), so that a cell sends a name only when they do not have it as the notebook does:
new, given another object since (a weak reference tells), or, for plain data that cannot
be referenced weakly, changed in place (its serialized bytes tell). What a replica
assigned itself stays until the notebook's name changes.

Example::

    >>> from colab_xla.wire.cell import Cell
    >>> known, ns = KnownNames(), {"lr": [0.1]}
    >>> known.pack(Cell("lr"), ns)[1]
    ['lr']
    >>> known.sent(["lr"], ns)
    >>> known.pack(Cell("lr"), ns)
    (None, [])
"""

from __future__ import annotations

import hashlib
import pickle
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple

import cloudpickle

from ...wire import names
from ...wire.cell import Cell


class KnownNames:
    """The notebook names warm replicas have (a session's, here or on every host of a
    cluster), as they were when sent: a name goes again when the notebook gave it another
    object since, or changed plain data in place."""

    def __init__(self):
        self._known: Dict[str, _Known] = {}

    def pack(self, cell: Cell,
             user_ns: Mapping[str, Any]) -> Tuple[Optional[bytes], List[str]]:
        """The names ``cell`` uses that the replicas do not have as they are in
        ``user_ns``: packed (None if none), and their names."""
        changed = []
        for name in names.used_names(cell, user_ns):
            known = self._known.get(name)
            if known is None or known.changed(user_ns[name]):
                changed.append(name)
        if not changed:
            return None, []
        return names.pack(changed, user_ns, names.SESSION), changed

    def sent(self, sent_names: List[str], user_ns: Mapping[str, Any]) -> None:
        """The replicas now have ``sent_names`` as ``user_ns`` has them."""
        for name in sent_names:
            self._known[name] = _Known(user_ns[name])


class _Known:
    """What the replicas have of a notebook name: its object (weakly where it can be),
    and for plain data, which cannot be referenced weakly, its serialized bytes' digest
    (so that a list changed in place is sent again)."""

    def __init__(self, value):
        try:
            self._ref = weakref.ref(value)
            self._digest = None
        except TypeError:
            self._ref = lambda value=value: value
            self._digest = _digest(value)

    def changed(self, value) -> bool:
        if self._ref() is not value:
            return True
        return self._digest is not None and _digest(value) != self._digest


def _digest(value) -> Optional[bytes]:
    try:
        return hashlib.blake2b(cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL),
                               digest_size=16).digest()
    except Exception:  # noqa: BLE001 - packing it says why, if a cell sends it
        return None
