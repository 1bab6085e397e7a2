"""A notebook cell: its text parsed once (:class:`Cell`), and written as an importable
module file (:class:`CellModule`).

A :class:`Cell` is made once, where the cell enters colab_xla (the magic, ``run_cell``),
and handed down: everything that reads the cell (is it empty, its syntax, the notebook
names it uses, a call that would start replicas from every replica, its module) reads
the one parse. It pickles with its parse, so a cluster's hosts get it as the notebook
made it.

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
    ...     module = CellModule.create(Cell("x = 2\\nx * 21\\n", label="Cell In[7]"), d)
    ...     ns = {"__name__": module.name}
    ...     exec(module.body, ns)
    ...     eval(module.last_expr, ns)
    42
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import marshal
import os
from dataclasses import dataclass
from types import CodeType
from secrets import token_hex
from typing import FrozenSet, List, Optional

from ..errors import SetupError

_counter = itertools.count(1)


class EmptyCellError(SetupError):
    """The cell has no code to run."""


class Cell:
    """A cell's ``source``, parsed once, as its module file will hold it (``header``, the
    magic line, as line 1; None for a cell that had none, auto mode's: its own line 1 is
    the file's; ``label``, how tracebacks name it: ``Cell In[7]``).

    ``tree`` is the parse (None if the cell has a syntax error, kept in ``syntax_error``
    and raised by :meth:`check`); ``names`` every name the cell mentions. Nothing else
    parses the source again.
    """

    def __init__(self, source: str, label: str = "cell",
                 header: Optional[str] = "# %%xla_spawn"):
        self.source, self.label = source, label
        self.header_lines = 0 if header is None else 1  # (the file's lines before source)
        self.text = source if header is None else header.replace("\n", " ") + "\n" + source
        self.tree: Optional[ast.Module] = None
        self.syntax_error: Optional[SyntaxError] = None
        try:
            self.tree = ast.parse(self.text, filename=label)
        except SyntaxError as exc:
            self.syntax_error = exc
        self.names: FrozenSet[str] = frozenset(
            node.id for node in ast.walk(self.tree) if isinstance(node, ast.Name)
        ) if self.tree is not None else frozenset()

    @property
    def empty(self) -> bool:
        """No code to run (a cell with a syntax error has some: compiling it says where)."""
        return not self.source.strip() or (self.tree is not None and not self.tree.body)

    def check(self) -> None:
        """Raise :class:`EmptyCellError` for a cell with no code, and its ``SyntaxError``
        (``filename`` the label, the notebook's line number)."""
        if self.empty:
            raise EmptyCellError("the cell has no code to run")
        if self.syntax_error is not None:
            raise self.syntax_error.with_traceback(None)

    def calls(self):
        """``(line, owner, name)`` of every call of the form ``owner.name(...)`` or
        ``a.owner.name(...)``, in the notebook's line numbers."""
        for node in ast.walk(self.tree) if self.tree is not None else ():
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                owner = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id",
                                                                                   None)
                yield node.lineno, owner, node.func.attr


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
    header_lines: int = 1  # the file's lines before the cell's own (its magic's line)

    @classmethod
    def create(cls, cell: Cell, directory: str) -> "CellModule":
        """Write ``cell`` under ``directory`` as a new module and compile its parse.

        Raises :class:`EmptyCellError` for a cell with no code, and ``SyntaxError`` (with
        ``filename`` set to the cell's label and the notebook's line number) before
        anything runs.
        """
        cell.check()
        name = f"xla_cell_{next(_counter)}_{token_hex(4)}"
        path = os.path.join(directory, name + ".py")
        # O_EXCL: never write through a file someone else put there. (Written with one
        # write(2): a text file object costs four more system calls, at every warm cell.)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            data = memoryview(cell.text.encode("utf-8"))
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
        body, last_expr = _compile(cell.tree, cell.text, path)
        return cls(name=name, path=path, label=cell.label, body=body, last_expr=last_expr,
                   source=cell.source, header_lines=cell.header_lines)

    @classmethod
    def load(cls, path: str, label: str = "cell", header_lines: int = 1) -> "CellModule":
        """The module written by :meth:`create`, compiled again from its file (in a
        replica of another Python than the notebook's: see :meth:`__reduce__`)."""
        with open(path, encoding="utf-8") as f:
            text = f.read()
        body, last_expr = _compile(ast.parse(text, filename=path), text, path)
        name = os.path.splitext(os.path.basename(path))[0]
        return cls(name=name, path=path, label=label, body=body, last_expr=last_expr,
                   source=text.split("\n", header_lines)[-1] if header_lines else text,
                   header_lines=header_lines)

    @property
    def lines(self) -> List[str]:
        """The module file's lines as its frames number them (the magic's line, if it
        has one, left blank here)."""
        return [""] * self.header_lines + self.source.splitlines()

    def parts(self) -> tuple:
        """The module as plain data (strings and bytes), as it pickles (:meth:`__reduce__`).
        Code objects do not pickle, but they marshal: a replica that
        did not fork (a session's, for every cell; spawn, a forkserver) gets the compiled
        cell, in marshal's format of this Python, and compiles the file again only if it
        runs another (so N replicas do not read, parse and compile it N times a cell)."""
        return (self.path, self.label, self.source, importlib.util.MAGIC_NUMBER,
                marshal.dumps((self.body, self.last_expr)), self.header_lines)

    def __reduce__(self):
        return _unmarshalled, self.parts()


def _unmarshalled(path: str, label: str, source: str, magic: bytes,
                  code: bytes, header_lines: int = 1) -> CellModule:
    """A :class:`CellModule` as :meth:`CellModule.parts` gave it: its code objects as the
    notebook compiled them where this Python reads their format, else compiled again from
    the file."""
    if magic != importlib.util.MAGIC_NUMBER:
        return CellModule.load(path, label, header_lines)
    body, last_expr = marshal.loads(code)
    return CellModule(name=os.path.splitext(os.path.basename(path))[0], path=path,
                      label=label, body=body, last_expr=last_expr, source=source,
                      header_lines=header_lines)


def _compile(tree: ast.Module, text: str, path: str):
    """The cell's body and last expression (or None), compiled from its parse (which is
    left as it is: a cell may be compiled again)."""
    body, last_expr = tree.body, None
    if body and isinstance(body[-1], ast.Expr) and not _ends_with_semicolon(text):
        body, last_expr = body[:-1], compile(ast.Expression(body[-1].value), path, "eval")
    module = ast.Module(body=body, type_ignores=tree.type_ignores)
    return compile(module, path, "exec"), last_expr


def _ends_with_semicolon(text: str) -> bool:
    # IPython's rule: a trailing ';' on the last line hides the value.
    lines = [line.split("#", 1)[0].rstrip() for line in text.splitlines()]
    code = [line for line in lines if line]
    return bool(code) and code[-1].endswith(";")
