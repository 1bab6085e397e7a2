"""A cell body's IPython syntax (``%magic``, ``!command``, ``name?``, pasted prompts)
made Python, as the notebook's own cells are: IPython's ``shell.transform_cell``, except
where it could change nothing.

IPython's transform tokenizes the whole body to look for its syntax: ~0.5 ms of the
notebook's time for a cell of 20 lines (warm; more in a kernel between cells), before the
replicas are sent the cell. Its static transforms act only at a few kinds of place (a
line's start, an ``=`` followed by ``%`` or ``!``, a ``?``, a first line that is blank or
indented, a prompt), so a body with none of them is returned as it is, with the newline
IPython adds. Everything else goes through IPython: a single line (its prefilter, which
depends on the namespace: automagic, autocall, macros), a body with any such place (in a
string or a comment too), and any shell whose transformers are not IPython's own (an
extension's, or this package's auto mode while it is not suspended).
"""

from __future__ import annotations

import functools
import re
from typing import Tuple

# Every place IPython's static transforms (IPython.core.inputtransformer2, 7.x to 9.x) act
# at, and more: an escape or a prompt at a line's start (also inside brackets, where
# IPython would not look), a "?" anywhere, "= %" and "= !".
_MAYBE_IPYTHON = re.compile(r"^\s*(?:[%!?,;/]|>>>|\.\.\.|In \[)|\?|=\s*[%!]", re.MULTILINE)


def transform(shell, body: str, own: tuple = ()) -> str:
    """``shell.transform_cell(body)``: the same text, without IPython's tokenizing where
    it would return the body unchanged. ``own``: transformers of this package's that
    change nothing at the moment (auto mode's, suspended)."""
    if _unchanged_by(shell, body, own):
        return body if body.endswith("\n") else body + "\n"
    return shell.transform_cell(body)


def _unchanged_by(shell, body: str, own: tuple) -> bool:
    if not body[:1].strip() or len(body.splitlines()) < 2 or _MAYBE_IPYTHON.search(body):
        return False
    manager = getattr(shell, "input_transformer_manager", None)
    if manager is None or getattr(shell, "input_transformers_post", None):
        return False
    cleanup, line, token = _defaults()
    return (all(t in own or t in cleanup for t in manager.cleanup_transforms)
            and all(t in line for t in manager.line_transforms)
            and all(t in token for t in manager.token_transformers))


@functools.lru_cache(maxsize=None)
def _defaults() -> Tuple[tuple, tuple, tuple]:
    """IPython's own transformers: a new TransformerManager's (module-level objects)."""
    from IPython.core.inputtransformer2 import TransformerManager

    fresh = TransformerManager()
    return (tuple(fresh.cleanup_transforms), tuple(fresh.line_transforms),
            tuple(fresh.token_transformers))
