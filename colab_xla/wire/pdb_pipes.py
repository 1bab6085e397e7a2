"""What ``%xla_debug``'s two pipes carry, agreed by both ends (IPython-free): the replica's
pdb writes its output to one and reads its answers from the other; each prompt it writes
ends with :data:`PROMPT_END`, which no output line has, so the notebook knows a prompt by
that mark, not by a pause after an unended line (under load, pdb's own lines arrive in
parts with pauses between them).

>>> split_prompt("> Cell In[3](4)load()\\n-> return 1 / d\\n(Pdb) " + PROMPT_END)
('> Cell In[3](4)load()\\n-> return 1 / d\\n', '(Pdb) ')
>>> split_prompt("-> return 1 / d") is None
True
"""

from __future__ import annotations

from typing import Optional, Tuple

# (ASCII's record separator: never in what pdb prints of a program's lines and values.)
PROMPT_END = "\x1e"


def split_prompt(pending: str) -> Optional[Tuple[str, str]]:
    """``(output before it, prompt)`` if ``pending`` ends with a prompt; else None."""
    if not pending.endswith(PROMPT_END):
        return None
    shown, _, prompt = pending[:-len(PROMPT_END)].rpartition("\n")
    return (shown + "\n" if shown else ""), prompt
