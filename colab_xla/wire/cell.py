"""A notebook cell as an importable module file.

Replicas run the cell from a real ``.py`` file with a unique module name, so that:

* what the cell defines (functions, classes) has ``__module__`` set to an importable
  name and pickles by reference, instead of failing with "Can't pickle local object";
* tracebacks and ``inspect`` see the cell's own source lines;
* an edited cell never runs stale code (every run gets a new name and file).

The first line of the file stands for the magic line, so line numbers in the file are
the line numbers a person sees in the notebook cell.

Example::

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     cell = CellModule.create("x = 2\\nx * 21\\n", d, label="Cell In[7]")
    ...     ns = {"__name__": cell.name}
    ...     exec(cell.body, ns)
    ...     eval(cell.last_expr, ns)
    42
"""

from __future__ import annotations

import ast
import itertools
import os
import secrets
from dataclasses import dataclass
from types import CodeType
from typing import Optional

from ..errors import SetupError

_counter = itertools.count(1)


class EmptyCellError(SetupError):
    """The cell has no code to run."""


@dataclass(frozen=True)
class CellModule:
    """The compiled cell and where its source lives.

    ``body`` runs every statement but a trailing expression; ``last_expr`` (or None)
    evaluates that expression, whose value is the replica's result, as with IPython's
    ``Out``. A trailing ``;`` suppresses the result, also as in IPython.
    """

    name: str
    path: str
    label: str
    body: CodeType
    last_expr: Optional[CodeType]
    source: str = ""

    @classmethod
    def create(cls, source: str, directory: str, label: str = "cell",
               header: str = "# %%xla_spawn") -> "CellModule":
        """Write ``source`` under ``directory`` as a new module and compile it.

        Raises :class:`EmptyCellError` for a cell with no code, and ``SyntaxError`` (with
        ``filename`` set to ``label`` and the notebook's line number) before anything runs.
        """
        if not source.strip() or not _has_code(source):
            raise EmptyCellError("the cell has no code to run")
        name = f"xla_cell_{next(_counter)}_{secrets.token_hex(4)}"
        path = os.path.join(directory, name + ".py")
        text = header.replace("\n", " ") + "\n" + source
        # O_EXCL: never write through a file someone else put there.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            body, last_expr = _compile(text, path)
        except SyntaxError as exc:
            exc.filename = label
            raise
        return cls(name=name, path=path, label=label, body=body, last_expr=last_expr,
                   source=source)

    @classmethod
    def load(cls, path: str, label: str = "cell") -> "CellModule":
        """The module written by :meth:`create`, compiled again from its file."""
        with open(path, encoding="utf-8") as f:
            text = f.read()
        body, last_expr = _compile(text, path)
        name = os.path.splitext(os.path.basename(path))[0]
        return cls(name=name, path=path, label=label, body=body, last_expr=last_expr,
                   source=text.split("\n", 1)[1])

    def __reduce__(self):
        # Code objects do not pickle: a replica started by spawn or a forkserver gets the
        # file's path and compiles it again.
        return CellModule.load, (self.path, self.label)


def _has_code(source: str) -> bool:
    try:
        return bool(ast.parse(source).body)
    except SyntaxError:
        return True  # let compilation report it with the line number


def _compile(text: str, path: str):
    tree = ast.parse(text, filename=path)
    last_expr = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(text):
        last_expr = ast.Expression(tree.body.pop().value)
        last_expr = compile(last_expr, path, "eval")
    body = compile(tree, path, "exec")
    return body, last_expr


def _ends_with_semicolon(text: str) -> bool:
    # IPython's rule: a trailing ';' on the last line hides the value.
    lines = [line.split("#", 1)[0].rstrip() for line in text.splitlines()]
    code = [line for line in lines if line]
    return bool(code) and code[-1].endswith(";")
