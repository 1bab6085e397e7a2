"""Every cell on the session's replicas (``%xla_session auto``): a cell the person types
without a magic runs as if it began with ``%%xla_spawn``.

The switch is :data:`state`; :func:`transform` is the input transformer (a function of a
cell's lines, IPython-free) that the extension adds to IPython's first ones
(``input_transformers_cleanup``), before IPython looks for a cell magic. What stays in the
notebook:

* a cell that begins with a ``%xla_`` magic (``%xla_session auto off``, ``%xla_doctor``) or
  is ``%%xla_spawn`` already (its options apply);
* a cell that begins with another cell magic keeps its meaning: the magics that run their
  body as Python (``%%time``, ``%%timeit``, ``%%capture``, ``%%prun``) transform it as a cell,
  so the body runs on the replicas and ``%%time`` times the replicas' run; the others
  (``%%bash``, ``%%writefile``, ``%%html``, ...) run in the notebook as written;
* ``%%xla_local``: the rest of the cell runs in the notebook;
* a cell with nothing but blank lines and comments;
* every cell once the session is stopped (auto mode ends with it, saying so; a session that
  ended by itself is still there, and its cells are refused with the reason until
  ``%xla_session restart``).

Everything else, line magics and ``!`` commands included, runs on the replicas (``name?``
shows the replica's object), its lines numbered as the person wrote them: the
``%%xla_spawn`` line is auto mode's (:func:`made_here`), not the cell's line 1. While a
magic's own body is read (:func:`suspended`), nothing is transformed: ``%%xla_spawn`` reads
its body with IPython's transformer, which would add itself again.

>>> state.on = True
>>> transform(["x = 1\\n", "x\\n"])
['%%xla_spawn\\n', 'x = 1\\n', 'x\\n']
>>> transform(["%xla_session auto off\\n"])
['%xla_session auto off\\n']
>>> state.on = False
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

MAGIC = "%%xla_spawn"
LOCAL = "%%xla_local"


class _State:
    on = False  # auto mode
    suspended = 0  # > 0 while a magic reads its own body (the notebook's one thread)
    # Whether the session auto mode is for is still there (stopped: auto mode ends with it;
    # one that ended by itself is there, and refuses cells with the reason). None: not asked.
    session_kept: Optional[Callable[[], bool]] = None
    # The body of the last cell transform put %%xla_spawn on (None: the last it read it
    # left alone). IPython hands the magic that body, as its whole cell: made_here.
    made: Optional[str] = None


state = _State()


def transform(lines: List[str]) -> List[str]:
    """``lines`` of a cell, with ``%%xla_spawn`` on top if the cell is the replicas'."""
    if state.suspended:
        return lines
    state.made = None
    if not state.on:
        return lines
    if state.session_kept is not None and not state.session_kept():
        state.on = False
        print("colab_xla: auto mode ended with the session; this cell runs in the notebook.")
        return lines
    first = next((line.strip() for line in lines
                  if line.strip() and not line.lstrip().startswith("#")), None)
    if first is None or first.startswith(("%xla_", "%%")):
        return lines
    state.made = "".join(lines)
    return [MAGIC + "\n", *lines]


def made_here(line: str, cell: str) -> bool:
    """Whether the ``%%xla_spawn`` cell of ``line`` and body ``cell`` is one
    :func:`transform` made of a cell the person wrote without it: the cell's line 1 is
    then the person's first line, not the magic's (else a traceback's "line 3" would be the
    cell's second line). Asked once per cell."""
    made, state.made = state.made, None
    return not line.strip() and made is not None and made == cell


@contextlib.contextmanager
def suspended():
    """Cells read in this block are not transformed (a magic's own body)."""
    state.suspended += 1
    try:
        yield
    finally:
        state.suspended -= 1


def install(shell, session_of: Callable[[], object]) -> None:
    """Add :func:`transform` to ``shell``'s first input transformers (once; it changes no
    cell until auto mode is on); auto mode ends when ``session_of()`` gives None."""
    state.session_kept = lambda: session_of() is not None
    if transform not in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.append(transform)


def uninstall(shell) -> None:
    state.on = False
    if transform in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.remove(transform)
