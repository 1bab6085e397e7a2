"""The package's shape, read from its source: which side imports which, and no cycles.

colab_xla is laid out by which process runs the code (docs/architecture.md):

* ``colab_xla/notebook/``: the notebook's side (magics, planning, checks, supervising, views;
  also what a cluster host's agent runs for the notebook);
* ``colab_xla/replica/``: everything that runs in a replica process or thread;
* ``colab_xla/wire/``: what crosses between them (jobs, reports, frames, values), a leaf
  both import;
* ``colab_xla/runtimes/``: a runtime per module, its notebook half and its replica half;
* ``colab_xla/errors.py``: the refusals and problems found before a run, a leaf.

Every import counts here, lazy (inside a function) and type-only ones included: each is a
real dependency of the file, and a cycle through one is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "colab_xla"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> List[Tuple[str, int, bool]]:
    """(module imported, line, whether inside a function) for every import of the file,
    resolved to full module names (a name taken from a package that is a submodule counts
    as that submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                for alias in child.names:
                    sub = f"{source}.{alias.name}"
                    found.append((sub if sub in MODULES else source, child.lineno, inner))
            visit(child, inner)

    visit(tree, False)
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _side(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "colab_xla":
        return "outside"
    return parts[1] if len(parts) > 1 and parts[1] in (
        "notebook", "replica", "wire", "runtimes", "errors") else "top"


def _violations(side: str, allowed) -> List[str]:
    bad = []
    for name, imports in IMPORTS.items():
        if _side(name) != side:
            continue
        for target, line, nested in imports:
            why = allowed(name, target, nested)
            if why:
                bad.append(f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} imports "
                           f"{target}: {why}")
    return bad


def test_the_package_has_the_sides_this_test_reads():
    sides = {_side(name) for name in MODULES}
    assert {"notebook", "replica", "wire", "runtimes", "errors"} <= sides
    assert "colab_xla.replica.entry" in MODULES and "colab_xla.notebook.launch" in MODULES


def test_what_crosses_is_a_leaf_both_sides_import():
    def allowed(name, target, nested):
        if _side(target) in ("notebook", "replica", "runtimes", "top"):
            return "the wire imports only the wire (and colab_xla.errors)"
        if target.split(".")[0] in ("IPython", "ipywidgets", "ipykernel"):
            return "the wire imports no IPython"
        return None
    assert _violations("wire", allowed) == []
    assert _violations("errors", allowed) == []


# The replica side runs the user's own IPython calls in a cell: `%time` becomes
# get_ipython().run_line_magic(...) (replica/job.py's replica_shell), and display()
# is IPython's (replica/capture.py's replica_display). Those two, inside their function,
# are the only IPython imports it has.
REPLICA_IPYTHON = {("colab_xla.replica.job", "IPython.core.interactiveshell"),
                   ("colab_xla.replica.job", "traitlets.config"),
                   ("colab_xla.replica.capture", "IPython.core.displaypub")}


def test_the_replica_side_never_imports_the_notebook_side_or_ipython():
    def allowed(name, target, nested):
        if _side(target) in ("notebook", "top"):
            return "the replica side never imports the notebook side"
        if target.split(".")[0] in ("IPython", "ipywidgets", "ipykernel", "traitlets"):
            if (name, target) in REPLICA_IPYTHON and nested:
                return None
            return "the replica side imports no IPython (but for a cell's own IPython calls)"
        return None
    assert _violations("replica", allowed) == []


def test_the_notebook_side_reaches_the_replicas_only_through_the_launchers_entry():
    def allowed(name, target, nested):
        if _side(target) != "replica":
            return None
        if name == "colab_xla.notebook.launch" and target == "colab_xla.replica.entry":
            return None
        return ("only colab_xla.notebook.launch imports the replica side, and only "
                "colab_xla.replica.entry")
    assert _violations("notebook", allowed) == []


def test_only_the_notebook_side_and_the_extension_entry_import_ipython_glue():
    def allowed(name, target, nested):
        if target.startswith(("IPython.core.magic", "ipywidgets")):
            if name in ("colab_xla.notebook.magics", "colab_xla.notebook.views.widget"):
                return None
            return "only the magics and the widget view import IPython's magics or ipywidgets"
        return None
    for side in ("notebook", "replica", "wire", "runtimes", "errors", "top"):
        assert _violations(side, allowed) == []


def _cycles() -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: Dict[str, Set[str]] = {
        name: {t for t, _, _ in imports if t in MODULES and t != name}
        for name, imports in IMPORTS.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_import_cycle_lazy_and_type_only_imports_included():
    assert _cycles() == []


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import(monkeypatch):
    fake = {"colab_xla.wire.a": [("colab_xla.wire.b", 1, False)],
            "colab_xla.wire.b": [("colab_xla.wire.a", 9, True)]}
    monkeypatch.setitem(globals(), "IMPORTS", fake)
    monkeypatch.setitem(globals(), "MODULES", {**MODULES, **dict.fromkeys(fake, PACKAGE)})
    assert _cycles() == [["colab_xla.wire.a", "colab_xla.wire.b"]]


@pytest.mark.parametrize("source,target", [
    ("colab_xla.replica.job", "colab_xla.notebook.outcome"),
    ("colab_xla.notebook.targets.session", "colab_xla.replica.process"),
    ("colab_xla.wire.values", "colab_xla.notebook.outcome"),
])
def test_each_rule_fails_on_an_import_that_breaks_it(monkeypatch, source, target):
    broken = {**IMPORTS, source: [*IMPORTS[source], (target, 1, True)]}
    monkeypatch.setitem(globals(), "IMPORTS", broken)
    rules = (test_what_crosses_is_a_leaf_both_sides_import,
             test_the_replica_side_never_imports_the_notebook_side_or_ipython,
             test_the_notebook_side_reaches_the_replicas_only_through_the_launchers_entry)
    failed = 0
    for rule in rules:
        try:
            rule()
        except AssertionError:
            failed += 1
    assert failed == 1
