"""The package's shape, read from its source: which side imports which, and no cycles.

colab_xla is laid out by which process runs the code (docs/architecture.md):

* ``colab_xla/notebook/``: the notebook's side (magics, planning, checks, supervising, views;
  also what a cluster host's agent runs for the notebook);
* ``colab_xla/replica/``: everything that runs in a replica process or thread;
* ``colab_xla/wire/``: what crosses between them (jobs, reports, frames, values), a leaf
  both import;
* ``colab_xla/runtimes/``: a runtime per module (its notebook half and its replica half),
  behind one interface and a registry, with what their replica halves use; it never
  imports the notebook side, the replica side (or IPython),
  and no module but a runtime's own compares a runtime's name: everything else asks the
  runtime;
* ``colab_xla/errors.py``: the refusals and problems found before a run, a leaf.

Every import counts here, lazy (inside a function) and type-only ones included: each is a
real dependency of the file, and a cycle through one is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

pytestmark = [pytest.mark.quick]  # the source read: the same on every stack

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
# get_ipython().run_line_magic(...) (replica/execution.py's replica_shell), and display()
# is IPython's (replica/capture.py's replica_display). Those two, inside their function,
# are the only IPython imports it has.
REPLICA_IPYTHON = {("colab_xla.replica.execution", "IPython.core.interactiveshell"),
                   ("colab_xla.replica.execution", "traitlets.config"),
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


def test_a_runtime_never_imports_the_notebook_side_or_ipython():
    def allowed(name, target, nested):
        if _side(target) in ("notebook", "top"):
            return "a runtime never imports the notebook side (it is given what it needs)"
        if target.split(".")[0] in ("IPython", "ipywidgets", "ipykernel", "traitlets"):
            return "a runtime imports no IPython"
        return None
    assert _violations("runtimes", allowed) == []


@pytest.mark.parametrize("source,target", [
    ("colab_xla.replica.execution", "colab_xla.notebook.outcome"),
    ("colab_xla.notebook.targets.session", "colab_xla.replica.process"),
    ("colab_xla.wire.values", "colab_xla.notebook.outcome"),
    ("colab_xla.runtimes.jax", "colab_xla.notebook.launch"),
    ("colab_xla.runtimes.plan", "IPython.core.error"),
])
def test_each_rule_fails_on_an_import_that_breaks_it(monkeypatch, source, target):
    broken = {**IMPORTS, source: [*IMPORTS[source], (target, 1, True)]}
    monkeypatch.setitem(globals(), "IMPORTS", broken)
    rules = (test_what_crosses_is_a_leaf_both_sides_import,
             test_the_replica_side_never_imports_the_notebook_side_or_ipython,
             test_the_notebook_side_reaches_the_replicas_only_through_the_launchers_entry,
             test_a_runtime_never_imports_the_notebook_side_or_ipython)
    failed = 0
    for rule in rules:
        try:
            rule()
        except AssertionError:
            failed += 1
    assert failed == 1


# -- runtime names ----------------------------------------------------------------------------
# A runtime is one module behind one interface (colab_xla/runtimes/): what depends on the
# runtime asks it (plan.runtime.own_processes(plan), runtime.cluster_replicas(host)...). A
# comparison with a runtime's name anywhere else is a decision taken outside it, which the
# next runtime would have to find and edit.


def _runtime_names() -> Tuple[str, ...]:
    from colab_xla.runtimes import RUNTIMES  # (imports neither torch_xla nor jax)

    return RUNTIMES


def _name_comparisons(tree: ast.AST, names) -> List[Tuple[int, str]]:
    """(line, what) for each comparison with a runtime's name in ``tree``: a Compare one
    of whose sides (or an element of a tuple, list or set side) is the name as a string
    constant, a ``case "name":``, or a call of the old ``is_jax``."""
    def named(node) -> bool:
        return (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value in names)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            elements = [e for side in sides for e in (
                side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])]
            if any(named(e) for e in elements):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and named(node.value):
            found.append((node.value.lineno, f"case {ast.unparse(node.value)}"))
        elif isinstance(node, ast.Call):
            func = node.func
            if getattr(func, "id", None) == "is_jax" or getattr(func, "attr", None) == "is_jax":
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_but_a_runtimes_own_compares_a_runtime_name():
    names = _runtime_names()
    own = {f"colab_xla.runtimes.{name}" for name in names}
    assert own <= set(MODULES)  # (each registered runtime is a module of that name)
    bad = [f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {what}"
           for module, path in MODULES.items() if module not in own
           for line, what in _name_comparisons(ast.parse(path.read_text(), str(path)), names)]
    assert bad == [], "ask the runtime (colab_xla.runtimes) instead of comparing its name"


def test_the_name_check_finds_what_it_is_for_and_not_a_module_name():
    names = ("torch_xla", "jax")
    compared = """
if launch.runtime == "jax": pass
if runtime != 'torch_xla': pass
ok = runtime in ("jax", "other")
ok = "torch_xla" == how
if jax_runtime.is_jax(environ) or is_jax(): pass
match launch.runtime:
    case "jax": pass
"""
    assert [line for line, _ in _name_comparisons(ast.parse(compared), names)] == \
        [2, 3, 4, 5, 6, 6, 8]
    not_compared = """
torch_xla = sys.modules.get("torch_xla")
if versions["torch_xla"] is None: pass
if runtime is get(): pass
TPU_USERS = ("jax", "jaxlib")
if name in TPU_USERS: pass
"""
    assert _name_comparisons(ast.parse(not_compared), names) == []


# -- the layers -------------------------------------------------------------------------------
# colab_xla is a stack of layers, each importing only its own and those below it
# (docs/architecture.md): the notebook's entry (the extension, the magics, %xla_doctor)
# -> the targets (where a cell runs, a cluster's connection and each host's agent among
# them) -> the run's machinery on the notebook's side (the supervisor, the launcher, the
# checks, the views) -> the replica side -> the runtimes (each runtime's two halves) ->
# the wire -> the errors. Every import counts, inside a function too.

LAYERS = ("errors", "wire", "runtimes", "replica", "supervisor", "targets", "notebook")
ENTRY = ("colab_xla", "colab_xla.notebook.magics", "colab_xla.notebook.doctor")


def _layer(module: str) -> str:
    side = _side(module)
    if side == "top" or module in ENTRY:
        return "notebook"
    if side != "notebook":
        return side
    if module.startswith(("colab_xla.notebook.targets", "colab_xla.notebook.cluster")):
        return "targets"
    return "supervisor"


def _upward_imports() -> List[str]:
    bad = []
    for name, imports in IMPORTS.items():
        below = LAYERS.index(_layer(name))
        for target, line, nested in imports:
            if _side(target) == "outside" or LAYERS.index(_layer(target)) <= below:
                continue
            where = "inside a function" if nested else "at module level"
            bad.append(f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} ({_layer(name)}) "
                       f"imports {target} ({_layer(target)}) {where}")
    return bad


def test_every_module_has_a_layer():
    layers = {_layer(name) for name in MODULES}
    assert layers == set(LAYERS)
    assert _layer("colab_xla.notebook.cluster.agent") == "targets"
    assert _layer("colab_xla.notebook.launch") == "supervisor"


def test_every_import_points_down_the_layers_inside_functions_too():
    assert _upward_imports() == []


@pytest.mark.parametrize("source,target,nested", [
    ("colab_xla.runtimes.torch_xla", "colab_xla.replica.process", True),
    ("colab_xla.notebook.supervisor", "colab_xla.notebook.targets.one_off", True),
    ("colab_xla.wire.job", "colab_xla.runtimes.plan", False),
    ("colab_xla.notebook.targets.one_off", "colab_xla.notebook.magics", False),
])
def test_the_layer_check_finds_an_upward_import(monkeypatch, source, target, nested):
    broken = {**IMPORTS, source: [*IMPORTS[source], (target, 1, nested)]}
    monkeypatch.setitem(globals(), "IMPORTS", broken)
    assert [b for b in _upward_imports() if f":1 ({_layer(source)}) imports {target}" in b]
