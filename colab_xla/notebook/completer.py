"""Tab in the notebook also offers what a session's replicas defined: :class:`ReplicaNames`,
a completion matcher the extension adds to IPython's (``Completer.custom_matchers``, the
simple kind IPython 7 and 9 both take: the text before the cursor in, full completions out).

While a session is up on this machine, ``mo<Tab>`` offers replica 0's ``model`` and
``model.fc.<Tab>`` the attributes of replica 0's object, beside the notebook's own
completions. Each answer is kept until the next cell runs, and a question waits at most
:data:`WAIT_SECONDS`: a session running a cell, or slow to answer, gives the notebook's
completions only. (A cluster's session: the notebook's only, for now.)
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple

from ..wire import completions

# How long Tab waits for replica 0's answer (it answers from a thread of its own, between
# cells: a few milliseconds).
WAIT_SECONDS = 0.08
_NAME = re.compile(r"^[A-Za-z_]\w*$")


class ReplicaNames:
    """The matcher is :meth:`matches` (IPython names a matcher by its ``__qualname__``);
    ``session_of()`` gives the session to ask (anything with ``names(expr, timeout)``,
    ``id``, ``cells_run``, ``up``), or None."""

    def __init__(self, session_of: Callable[[], object]):
        self._session_of = session_of
        self._kept: Dict[Tuple[str, int, str], List[str]] = {}  # this cell's answers

    def matches(self, text: str) -> List[str]:
        session = self._session_of()
        ask = getattr(session, "names", None)
        if ask is None or not getattr(session, "up", False):
            return []
        expr, dot, prefix = text.rpartition(".")
        if (dot and not completions.is_chain(expr)) or (prefix and not _NAME.match(prefix)):
            return []
        key = (session.id, session.cells_run, expr)
        found: Optional[List[str]] = self._kept.get(key)
        if found is None:
            found = ask(expr, WAIT_SECONDS)
            if found is None:  # busy, or late: nothing kept, asked again next time
                return []
            self._kept = {k: v for k, v in self._kept.items() if k[:2] == key[:2]}
            self._kept[key] = found
        head = expr + dot
        return [head + name for name in found if name.startswith(prefix)]


def install(shell, session_of: Callable[[], object]) -> None:
    """Add a :class:`ReplicaNames` to ``shell``'s completer (once)."""
    matchers = shell.Completer.custom_matchers
    if not any(_ours(m) for m in matchers):
        matchers.append(ReplicaNames(session_of).matches)


def uninstall(shell) -> None:
    matchers = shell.Completer.custom_matchers
    matchers[:] = [m for m in matchers if not _ours(m)]


def _ours(matcher) -> bool:
    return isinstance(getattr(matcher, "__self__", None), ReplicaNames)
