"""The one helper of the tests that run a cell on real replicas in this process."""

import textwrap
from typing import Optional

from colab_xla.notebook.targets import run_cell

LABEL = "Cell In[5]"  # how tracebacks name the cell, as a notebook would


def run(source: str, n: Optional[int] = None, *, label: str = LABEL, announce=None, **kw):
    """:func:`colab_xla.notebook.targets.run_cell` of ``source`` on ``n`` replicas (without
    ``n``, as many as ``run_cell``'s other keywords say), quietly (no announcement).
    ``source`` may be an indented triple-quoted string: it is dedented and its leading
    newlines dropped. Other keywords go to ``run_cell`` as they are."""
    if n is not None:
        kw["replicas"] = n
    return run_cell(textwrap.dedent(source).lstrip("\n"), label=label, announce=announce, **kw)
