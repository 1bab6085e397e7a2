"""Which of a session's replicas run a cell (``--targets``): :func:`parse` reads the
option, :meth:`Chosen.ordinals` says which replicas it names among a session's.

``--targets 0,2`` names replicas by ordinal, ``0-3`` a range of them; on a cluster's
session ``1:0`` names replica 0 of host 1 (``1:0-3``: a range on host 1), and a bare
ordinal is the global one (``%xla_session`` lists both). The replicas not chosen stay idle
and keep their state.

>>> chosen = parse("3, 0-1")
>>> chosen.ordinals([(0, 0), (0, 1), (0, 2), (0, 3)])
[0, 1, 3]
>>> parse("1:0-1").ordinals([(0, 0), (0, 1), (1, 0), (1, 1)])
[2, 3]
>>> parse("4").ordinals([(0, 0), (0, 1)])
Traceback (most recent call last):
...
colab_xla.errors.OptionError: --targets 4: there is no replica 4 (this session's are 0-1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from ..errors import OptionError

_ITEM = re.compile(r"^(?:(?P<host>\d+):)?(?P<first>\d+)(?:-(?P<last>\d+))?$")


@dataclass(frozen=True)
class Chosen:
    """The replicas ``--targets`` names: ``spans`` of (host or None, first, last)."""

    text: str
    spans: Tuple[Tuple[object, int, int], ...]

    def ordinals(self, layout: Sequence[Tuple[int, int]]) -> List[int]:
        """The global ordinals chosen, sorted; ``layout``: (host, ordinal on the host) of
        each of the session's replicas, by global ordinal. An
        :class:`~colab_xla.errors.OptionError` names one that does not exist."""
        found = set()
        for host, first, last in self.spans:
            for n in range(first, last + 1):
                if host is None:
                    if n >= len(layout):
                        raise OptionError(f"--targets {self.text}: there is no replica {n} "
                                          f"(this session's are {_span(len(layout))}).")
                    found.add(n)
                elif (host, n) in layout:
                    found.add(layout.index((host, n)))
                else:
                    hosts = sorted({h for h, _ in layout})
                    raise OptionError(
                        f"--targets {self.text}: there is no replica {host}:{n} (HOST:R, R "
                        f"the replica's ordinal on host HOST; this session's hosts are "
                        f"{', '.join(map(str, hosts))}: %xla_session lists their replicas).")
        return sorted(found)


def parse(text: str) -> Chosen:
    """``--targets``' value as a :class:`Chosen` (an
    :class:`~colab_xla.errors.OptionError` for one that is not a list of ordinals, ranges
    and HOST:R)."""
    spans = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _ITEM.match(item)
        first = int(match["first"]) if match else 0
        last = int(match["last"]) if match and match["last"] else first
        if not match or last < first:
            raise OptionError(f"--targets {text}: {item!r} is not a replica, a range of them "
                              "(0-3) or HOST:R; e.g. --targets 0,2 or --targets 0-3.")
        spans.append((int(match["host"]) if match["host"] else None, first, last))
    if not spans:
        raise OptionError("--targets: name at least one replica (e.g. --targets 0).")
    return Chosen(text, tuple(spans))


def _span(count: int) -> str:
    return "0" if count == 1 else f"0-{count - 1}"
