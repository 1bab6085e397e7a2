"""Tab in the notebook also offers what a session's replicas defined: :class:`ReplicaNames`,
a completion matcher the extension adds to IPython's (``Completer.custom_matchers``).

While a session is up on this machine, ``mo<Tab>`` offers replica 0's ``model`` and
``model.fc.<Tab>`` the attributes of replica 0's object, beside the notebook's own
completions, each typed as what the replica holds (``function``, ``module``, ``class``,
``instance``, ``property``), where IPython's matcher API v2 can say it (IPython 8.6 and
later; IPython 7, Colab's, takes the text before the cursor and full completions, untyped).
Each answer is kept until the next cell runs, and a question waits at most
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
    """The matcher is :meth:`typed` (IPython's matcher API v2: a completion context in,
    typed completions out) or :meth:`matches` (API v1: text in, completions out); IPython
    names a matcher by its ``__qualname__``. ``session_of()`` gives the session to ask
    (anything with ``names(expr, timeout)``, ``id``, ``cells_run``, ``up``), or None."""

    def __init__(self, session_of: Callable[[], object]):
        self._session_of = session_of
        self._kept: Dict[Tuple[str, int, str], List[List[str]]] = {}  # this cell's answers

    def found(self, text: str) -> List[Tuple[str, str]]:
        """``[(completion, kind), ...]`` of the replica's names that complete ``text`` (the
        token before the cursor: ``mo``, ``model.fc.we``)."""
        session = self._session_of()
        ask = getattr(session, "names", None)
        if ask is None or not getattr(session, "up", False):
            return []
        expr, dot, prefix = text.rpartition(".")
        if (dot and not completions.is_chain(expr)) or (prefix and not _NAME.match(prefix)):
            return []
        key = (session.id, session.cells_run, expr)
        found: Optional[List[List[str]]] = self._kept.get(key)
        if found is None:
            found = ask(expr, WAIT_SECONDS)
            if found is None:  # busy, or late: nothing kept, asked again next time
                return []
            self._kept = {k: v for k, v in self._kept.items() if k[:2] == key[:2]}
            self._kept[key] = found
        head = expr + dot
        return [(head + name, kind) for name, kind in found if name.startswith(prefix)]

    def matches(self, text: str) -> List[str]:
        """The matcher of IPython 7 (API v1): full completions of ``text``, untyped."""
        return [completion for completion, _ in self.found(text)]

    def typed(self, context) -> dict:
        """The matcher of IPython 8.6 and later (API v2): each completion of the context's
        token with its type."""
        from IPython.core.completer import SimpleCompletion

        return {"completions": [SimpleCompletion(completion, type=kind)
                                for completion, kind in self.found(context.token)],
                "suppress": False}

    typed.matcher_api_version = 2  # (what IPython's context_matcher() marks)


def install(shell, session_of: Callable[[], object]) -> None:
    """Add a :class:`ReplicaNames` to ``shell``'s completer (once): its typed matcher where
    IPython takes one (API v2), else its untyped one."""
    from IPython.core import completer as ipython_completer

    matchers = shell.Completer.custom_matchers
    if not any(_ours(m) for m in matchers):
        names = ReplicaNames(session_of)
        v2 = hasattr(ipython_completer, "context_matcher")  # (IPython 8.6 and later)
        matchers.append(names.typed if v2 else names.matches)


def uninstall(shell) -> None:
    matchers = shell.Completer.custom_matchers
    matchers[:] = [m for m in matchers if not _ours(m)]


def _ours(matcher) -> bool:
    return isinstance(getattr(matcher, "__self__", None), ReplicaNames)
