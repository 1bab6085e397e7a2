"""A cell body's IPython syntax (``%magic``, ``!command``, ``name?``, pasted prompts)
made Python, as the notebook's own cells are: IPython's ``shell.transform_cell``, without
the part of it that could change nothing.

IPython's transform has two parts: static transforms (``IPython.core.inputtransformer2``),
which tokenize the whole body to find its syntax, then, for a body of one line, dynamic ones
(its prefilter: automagic, autocall, macros, which depend on the namespace). The static part
runs before the replicas are sent the cell, tokenizing all of it. It acts only at a few
kinds of place (a line's start, an ``=`` followed by ``%`` or ``!``, a ``?``, a first line
that is blank or indented, a prompt), so for a body with none of them it is skipped, and the
rest of ``transform_cell`` is done as IPython (7.x to 9.x) does it: the newline it adds, the
prefilter for one line. Everything else goes through ``shell.transform_cell`` itself: a body
with any such place (in a string or a comment too), a shell whose transformers are not
IPython's own (an extension's, this package's auto mode while not suspended), and a shell
class with a ``transform_cell`` of its own.

Why a second way beside ``transform_cell``: tokenizing a body of many lines is a large part
of a warm session cell's time in the magic (tests/test_magic.py checks both give
the same text).
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Tuple

# Every place IPython's static transforms (IPython.core.inputtransformer2, 7.x to 9.x) act
# at, and more: an escape or a prompt at a line's start (also inside brackets, where
# IPython would not look), a "?" anywhere, "= %" and "= !".
_MAYBE_IPYTHON = re.compile(r"^\s*(?:[%!?,;/]|>>>|\.\.\.|In \[)|\?|=\s*[%!]", re.MULTILINE)


def transform(shell, body: str, own: tuple = ()) -> str:
    """``shell.transform_cell(body)``: the same text, without IPython's static transforms
    where they would change nothing. ``own``: transformers of this package's that change
    nothing at the moment (auto mode's, suspended)."""
    if not _static_unchanged(shell, body, own):
        return shell.transform_cell(body)
    cell = body if body.endswith("\n") else body + "\n"
    if len(cell.splitlines()) == 1:  # the dynamic transforms, as transform_cell runs them
        with shell.builtin_trap:
            cell = shell.prefilter_manager.prefilter_lines(cell) + "\n"
    return cell


def _static_unchanged(shell, body: str, own: tuple) -> bool:
    """Whether IPython's static transforms give ``body`` back as it is (plus a newline),
    and its ``transform_cell`` is IPython's own, with nothing after them."""
    if not body[:1].strip() or _MAYBE_IPYTHON.search(body):
        return False
    manager = getattr(shell, "input_transformer_manager", None)
    transform_cell, cleanup, line, token = _ipythons_own()
    if (manager is None or getattr(shell, "input_transformers_post", None)
            or getattr(type(shell), "transform_cell", None) is not transform_cell):
        return False
    return (all(t in own or t in cleanup for t in manager.cleanup_transforms)
            and all(t in line for t in manager.line_transforms)
            and all(t in token for t in manager.token_transformers))


@functools.lru_cache(maxsize=None)
def _ipythons_own() -> Tuple[Callable, tuple, tuple, tuple]:
    """IPython's own ``transform_cell``, and its transformers: a new TransformerManager's
    (module-level objects)."""
    from IPython.core.inputtransformer2 import TransformerManager
    from IPython.core.interactiveshell import InteractiveShell

    fresh = TransformerManager()
    return (InteractiveShell.transform_cell, tuple(fresh.cleanup_transforms),
            tuple(fresh.line_transforms), tuple(fresh.token_transformers))
