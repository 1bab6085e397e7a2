"""The ``%%xla_spawn`` line as arguments: split as a shell would, names checked. IPython-free.

IPython's ``parse_argstring`` splits with ``shlex`` in non-POSIX mode (IPython 7.34 and
later alike): quotes stay inside the values (``--env XLA_FLAGS="--a --b"`` gave
``XLA_FLAGS="--a`` and ``--b"``), and an unclosed quote raised a bare ValueError. Here
quotes group and are removed, a backslash escapes the next character, ``#`` is text::

    >>> split_line('-n 4 --env XLA_FLAGS="--xla_a --xla_b=1" -o out')
    ['-n', '4', '--env', 'XLA_FLAGS=--xla_a --xla_b=1', '-o', 'out']

IPython substitutes ``$name`` and ``{expr}`` of the notebook in a magic's line before the
magic sees it, so a value taken from a notebook variable keeps its spaces only in quotes:
``--env XLA_FLAGS="$flags"``.
"""

from __future__ import annotations

import keyword
import shlex
from typing import List, Optional, Sequence


class LineError(ValueError):
    """The line cannot be split into arguments (the message says where and what to do)."""


def split_line(line: str, magic: str = "%%xla_spawn") -> List[str]:
    """``line`` as a shell would split it, or :class:`LineError` for an unclosed quote or a
    backslash at the end."""
    lex = shlex.shlex(line, posix=True)
    lex.whitespace_split = True
    lex.commenters = ""  # "#" is text in a value (XLA_FLAGS, a path)
    args: List[str] = []
    while True:
        try:
            token = lex.get_token()
        except ValueError:
            raise LineError(_unsplittable(line, lex, magic)) from None
        if token is None:  # posix mode: None at the end (an empty token is "")
            return args
        args.append(token)


def pull_names(items: Sequence[str]) -> List[str]:
    """The names of every ``--pull``, in order, each once::

        >>> pull_names(["model,losses", " model "])
        ['model', 'losses']
    """
    names: List[str] = []
    for item in items:
        parts = [name.strip() for name in item.split(",") if name.strip()]
        if not parts:
            raise ValueError(f"--pull {shlex.quote(item)}: give one NAME or more "
                             "(--pull model,losses).")
        names += parts
    return list(dict.fromkeys(names))


def check_output(name: Optional[str], pull: Sequence[str]) -> None:
    """``-o NAME``: a variable the notebook can use, and not one --pull stores into too."""
    if name is None:
        return
    if not is_name(name):
        raise ValueError(f"-o {shlex.quote(name)}: NAME must be a Python identifier (not a "
                         "keyword), the notebook variable that gets the values.")
    if name in pull:
        raise ValueError(f"-o {name} and --pull {name} would both store into the notebook's "
                         f"{name}: give -o another NAME.")


def is_name(name: str) -> bool:
    """A name a notebook variable can have: ``losses``, not ``2fast`` or ``class``."""
    return name.isidentifier() and not keyword.iskeyword(name)


def _unsplittable(line: str, lex: shlex.shlex, magic: str) -> str:
    shown = f"{magic} {line.strip()}"
    if lex.state in lex.quotes:  # the line ended inside a quote
        quote, column = lex.state, _open_quote(line) + 1
        return (f"{shown}: the {quote} at column {column} opens a quoted value that is never "
                f"closed. Close it (--env XLA_FLAGS={quote}--a --b{quote}), or write a {quote} "
                f"that is part of a value as \\{quote}.")
    return (f"{shown}: the line ends with a backslash, which escapes nothing. Remove it, or "
            "write \\\\ for a backslash that is part of a value.")


def _open_quote(line: str) -> int:
    """Where the quote that is never closed starts (the rules of POSIX shlex)."""
    quote, start, i = None, -1, 0
    while i < len(line):
        c = line[i]
        if c == "\\" and quote != "'":
            i += 1  # escapes the next character (not inside '...')
        elif quote is None and c in "'\"":
            quote, start = c, i
        elif c == quote:
            quote = None
        i += 1
    return start
