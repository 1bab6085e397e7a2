"""The docs against what they describe: each page's option table is what the magic's own
parser renders (``tools/option_tables.py``), every local link of README.md and docs/ points at
a file that exists, every module and name docs/architecture.md (or a docstring, as
``colab_xla.x.y``) cites is the package's, and the README stays short. Pure units: no kernel,
no replicas."""

import ast
import collections
import json
import difflib
import re
import urllib.parse
from pathlib import Path

import pytest

import option_tables  # tools/, on sys.path through conftest.py
from colab_xla.notebook.magics import XlaMagics

# The parsers are IPython's magic_arguments: 7.34's in the colab stack.
pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab")]

ROOT = Path(__file__).resolve().parents[1]
PAGES = option_tables.pages(ROOT)
README_LIMIT = 15 * 1024  # bytes: the README is the product's front page, the docs the rest


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- option tables ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered():
    return option_tables.tables(XlaMagics)


def test_option_tables_are_what_the_parsers_render(rendered):
    stale = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        fresh = option_tables.rewrite(text, rendered, _name(page))
        if fresh != text:
            stale.append("".join(difflib.unified_diff(
                text.splitlines(True), fresh.splitlines(True), _name(page), "rendered", n=0)))
    assert not stale, ("option tables differ from the magics' parsers; run "
                       "python tools/option_tables.py\n" + "\n".join(stale))


def test_each_magic_has_one_option_table_in_the_docs():
    found = collections.Counter()
    for page in PAGES:
        found.update(option_tables.blocks(page.read_text(encoding="utf-8")))
    assert found == collections.Counter(option_tables.MAGICS)


@pytest.mark.parametrize("magic", option_tables.MAGICS)
def test_a_table_holds_every_option_and_its_help(rendered, magic):
    parser = getattr(XlaMagics, magic).parser
    table = rendered[magic]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(parser._actions)
    for action in parser._actions:
        names = action.option_strings or [action.dest.upper()]
        row = next(r for r in rows if f"`{names[0]}`" in r or f"`[{names[0]}]`" in r)
        assert all(f"`{name}" in row or f"[{name}]" in row for name in names)
        # The help as %%xla_spawn? prints it: argparse's %% is a plain % there.
        assert " ".join(action.help.replace("%%", "%").split()) in row.replace("\\|", "|")
        if action.choices:
            assert all(str(choice) in row for choice in action.choices)


def test_a_stale_block_is_rewritten_and_the_rest_left_alone(tmp_path, rendered):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n<!-- options: xla_doctor -->\n| old | table |\n"
                    "<!-- /options -->\n\nAfter.\n", encoding="utf-8")
    assert option_tables.drifted([page], rendered) == [page]
    fresh = option_tables.rewrite(page.read_text(encoding="utf-8"), rendered)
    assert fresh == ("# Title\n\n<!-- options: xla_doctor -->\n" + rendered["xla_doctor"]
                     + "<!-- /options -->\n\nAfter.\n")
    assert option_tables.rewrite(fresh, rendered) == fresh
    page.write_text(fresh, encoding="utf-8")
    assert option_tables.drifted([page], rendered) == []


def test_check_exits_1_naming_the_page_and_rewriting_fixes_it(tmp_path, monkeypatch, capsys):
    page = tmp_path / "page.md"
    page.write_text("<!-- options: xla_session -->\n<!-- /options -->\n", encoding="utf-8")
    monkeypatch.setattr(option_tables, "pages", lambda root=None: [page])
    assert option_tables.main(["--check"]) == 1
    assert str(page) in capsys.readouterr().err
    assert "options: xla_session" in page.read_text(encoding="utf-8")
    assert option_tables.main([]) == 0
    assert "`--devices-per-process`" in page.read_text(encoding="utf-8")
    assert option_tables.main(["--check"]) == 0


@pytest.mark.parametrize("text, says", [
    ("<!-- options: xla_nothing -->\n<!-- /options -->\n", "names no magic"),
    ("<!-- options: xla_spawn -->\nno end\n", "not closed"),
    ("<!-- options: xla_spawn -->\n<!-- options: xla_doctor -->\n<!-- /options -->\n",
     "not closed"),
    ("<!-- /options -->\n", "not closed"),
])
def test_a_broken_block_is_refused(rendered, text, says):
    with pytest.raises(ValueError, match=says):
        option_tables.rewrite(text, rendered)


def test_the_tool_exits_2_on_a_broken_block_and_writes_nothing(tmp_path, monkeypatch, capsys):
    good, broken = tmp_path / "good.md", tmp_path / "broken.md"
    good.write_text("<!-- options: xla_doctor -->\n<!-- /options -->\n", encoding="utf-8")
    broken.write_text("<!-- options: xla_doctor -->\n", encoding="utf-8")
    monkeypatch.setattr(option_tables, "pages", lambda root=None: [good, broken])
    assert option_tables.main([]) == 2
    assert "not closed" in capsys.readouterr().err
    assert good.read_text(encoding="utf-8") == "<!-- options: xla_doctor -->\n<!-- /options -->\n"


# --- links -----------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.DOTALL | re.MULTILINE)
_CODE = re.compile(r"(`+).+?\1", re.DOTALL)
_INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)


def local_links(text: str):
    """The targets of the page's Markdown links (inline, images, definitions) that name a
    local file, without their #anchor; links inside code are not links."""
    text = _CODE.sub("", _FENCE.sub("", text))
    for target in _INLINE.findall(text) + _DEFINITION.findall(text):
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor of the page itself
        path = urllib.parse.unquote(target.split("#", 1)[0].split("?", 1)[0])
        if path:
            yield path


def test_local_links_are_found_as_markdown_reads_them():
    text = ("[a](docs/a.md) ![b](b.png \"title\") [c](c.md#part) [d](https://x.org/d.md)\n"
            "[e](#here) [f](<my%20file.md>)\n`[g](g.md)`\n```\n[h](h.md)\n```\n"
            "[i]: ../i.md\n")
    assert list(local_links(text)) == ["docs/a.md", "b.png", "c.md", "my file.md", "../i.md"]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_local_links_point_at_files_that_exist(page):
    missing = [target for target in local_links(page.read_text(encoding="utf-8"))
               if not ((ROOT / target.lstrip("/")) if target.startswith("/")
                       else (page.parent / target)).exists()]
    assert not missing, f"{_name(page)} links to files that do not exist: {missing}"


def test_the_readme_stays_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, (f"README.md is {size} bytes (at most {README_LIMIT}): move "
                                  "the detail to a page of docs/ and link it")


def test_the_simulation_page_says_the_shared_memory_sizes_the_code_uses():
    """docs/simulation.md writes shm_collectives' sizes out in words (when a result goes
    through a file, how many files a group keeps, the room it leaves, a replica's slot):
    each as the code has it now."""
    from colab_xla.runtimes import shm_collectives as shm

    def mib(nbytes: int) -> str:
        return f"{nbytes >> 20} MiB"

    text = " ".join((ROOT / "docs" / "simulation.md").read_text().split())
    said = (f"all_reduce of {mib(shm.CHUNK_BYTES)} or more is reduced into one file",
            f"keeps up to {shm.POOL_FILES} such files",
            f"less than {mib(shm.ROOM_LEFT_BYTES)} of `/dev/shm` free",
            f"has no room for {mib(2 * shm.CHUNK_BYTES)} a replica")
    missing = [s for s in said if s not in text]
    assert not missing, f"docs/simulation.md does not say: {missing}"


def test_tutorial_01_says_how_cpu_replicas_are_simulated_as_the_code_does():
    """Its set-up text said "N CPU devices of one process" after the default became a
    process per replica: what it says of the default is read against the code."""
    from colab_xla.runtimes.simulation import SIMULATIONS
    from colab_xla.runtimes.torch_xla import DEFAULT_CPU_REPLICAS

    book = json.loads((ROOT / "notebooks" / "01-hello-replicas.ipynb").read_text())
    setup = next("".join(c["source"]) for c in book["cells"] if c.get("id") == "setup-md")
    said = " ".join(setup.split())
    assert SIMULATIONS[0] == "processes"  # the default, as the text says it
    assert "simulates N replicas: N processes, one CPU device each" in said
    assert f"without `-n`: {DEFAULT_CPU_REPLICAS}" in said
    assert f"`--simulate {SIMULATIONS[1]}`: N CPU devices of one process" in said


# --- names docs/architecture.md cites ----------------------------------------------------

PACKAGE = ROOT / "colab_xla"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
_CITED = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_CAPITALIZED = re.compile(r"_?[A-Z][A-Za-z0-9_]*")
_SECTION = re.compile(r"^## (?:.*?\(`([a-z_]+/)`\))?", re.MULTILINE)
# What a citation names outside the package: other libraries' modules, the doc's variables
# (``request`` is the parameter of ``Target.run(request, observer)``, not notebook/request.py).
FOREIGN = {"os", "sys", "xm", "xmp", "ray", "jax", "torch", "torch_xla", "multiprocessing",
           "request"}
FOREIGN_NAMES = {"KeyboardInterrupt", "PyThreadState_SetAsyncExc", "SIGINT", "PR_SET_PDEATHSIG",
                 "PR_SET_CHILD_SUBREAPER", "DataLoader", "Manager", "PJRT_DEVICE",
                 "CPU_NUM_DEVICES", "NULL"}


class _Names:
    """The package's modules and the names each defines, read by AST (nothing imported)."""

    def __init__(self):
        self.modules = {}  # dotted module name, without "colab_xla." -> the names it has
        self.classes = {}  # class name -> its ClassDef nodes, anywhere in the package
        self.defined = set()  # every name a module or class defines at its top
        self.strings = set()  # the package's string constants (COLAB_XLA_RUNTIME, a variable)
        for path in PACKAGE.rglob("*.py"):
            parts = path.relative_to(PACKAGE).with_suffix("").parts
            package = parts[-1] == "__init__"
            tree = ast.parse(path.read_text(encoding="utf-8"))
            own = self._members(tree)
            # A package's imports are its names (targets.run_cell); a module's are not
            # (ReplicaJob is wire.job's, whichever module imports it), but for its __all__.
            exported = set(self._all(tree)) | (self._members(tree, imports=True) if package
                                               else set())
            self.modules[".".join(parts[:-1] if package else parts)] = own | exported
            self.defined |= own
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append(node)
                    self.defined |= self._members(node)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    self.strings.add(node.value)

    @staticmethod
    def _all(tree) -> list:
        for node in tree.body:
            if (isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
                return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        return []

    @staticmethod
    def _members(node, imports: bool = False) -> set:
        """What a module or class body defines: defs, classes, assignments (``imports``:
        and what it imports; for a class, what its methods assign to ``self``)."""
        found = set()
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(child.name)
            elif isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in getattr(child, "targets", [getattr(child, "target", None)]):
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            found.add(leaf.id)
            elif isinstance(child, (ast.Import, ast.ImportFrom)) and imports:
                found |= {(a.asname or a.name).split(".")[0] for a in child.names}
            elif isinstance(child, (ast.If, ast.Try)):
                body = child.body + child.orelse + [n for h in getattr(child, "handlers", [])
                                                    for n in h.body]
                found |= _Names._members(ast.Module(body=body, type_ignores=[]), imports)
        if isinstance(node, ast.ClassDef):
            for leaf in ast.walk(node):
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                        and leaf.value.id == "self" and isinstance(leaf.ctx, ast.Store)):
                    found.add(leaf.attr)
        return found

    def resolves(self, dotted: str) -> bool:
        """Whether ``dotted`` (``replica.execution``, ``Supervisor._handle``,
        ``colab_xla.notebook.targets.run_cell``) names what the package has: a module (by
        its full name or its last parts: ``targets`` is ``notebook.targets``), then a name
        it defines, then a class's member; past a function or a value, nothing is checked."""
        parts = dotted.split(".")
        if parts[0] == "colab_xla":
            parts = parts[1:]
        for split in range(len(parts), 0, -1):
            head = ".".join(parts[:split])
            for module, names in self.modules.items():
                if module == head or module.endswith("." + head):
                    rest = parts[split:]
                    if not rest or (rest[0] in names and self._member(rest[0], rest[1:])):
                        return True
        return parts[0] in self.classes and self._member(parts[0], parts[1:])

    def _member(self, name: str, rest) -> bool:
        """``rest`` is a chain of members of ``name``, if it is a class (else not checked)."""
        if not rest or name not in self.classes:
            return name not in self.classes or not rest
        return any(rest[0] in self._members(c) and self._member(rest[0], rest[1:])
                   for c in self.classes[name])


@pytest.fixture(scope="module")
def package_names():
    return _Names()


def citations(text: str):
    """(section directory, cited text) for each backticked citation of the page, the section
    directory being the one its ``## ... (`dir/`)`` heading names (None under another)."""
    sections = [(m.start(), m.group(1)) for m in _SECTION.finditer(text)]
    prose = _FENCE.sub(lambda block: re.sub(r"[^\n]", " ", block.group(0)), text)
    for m in _CITED.finditer(prose):
        directory = None
        for start, named in sections:
            if start < m.start():
                directory = named
        yield directory, m.group(1).strip()


def cited_path_exists(path: str, directory) -> bool:
    """A path as the page cites it: from the repository, from the package, or (a file's own
    name, ``magics.py``) a file under its section's directory, in any folder of it."""
    if (ROOT / path).exists() or (PACKAGE / path).exists():
        return True
    under = PACKAGE / directory if directory else PACKAGE
    path = path.rstrip("/")
    return any(str(found).endswith("/" + path) for found in under.rglob(Path(path).name))


def stale_citations(text: str, names: _Names):
    stale = []
    for directory, cited in citations(text):
        word = re.sub(r"\(.*\)$", "", cited)  # a call: `targets.current()`, `run(request, ..)`
        if "<" in word or " " in word or word.startswith(("/", "-", "%", "$")):
            continue  # a template, a phrase, an absolute path, an option, a magic
        if re.fullmatch(r"[\w/.-]+\.(py|md|ipynb)|[\w/]+/", word):
            if not cited_path_exists(word, directory):
                stale.append(cited)
        elif _DOTTED.fullmatch(word):
            if word.split(".")[0] not in FOREIGN and not names.resolves(word):
                stale.append(cited)
        elif _CAPITALIZED.fullmatch(word) and word not in FOREIGN_NAMES:
            if not (word in names.defined or word in names.classes
                    or (word.isupper() and word in names.strings)):
                stale.append(cited)
    return stale


def test_a_stale_citation_is_found(package_names):
    text = ("# Page\n\n## The replica's side (`replica/`)\n\n- `job.py`, `execution.py`, "
            "`entry.py`, `wire/job.py`, `replica/serve.py`, `tests/test_docs.py`, `views/`\n"
            "- `replica.execution`, `replica.execution.ReplicaJob`, `wire.job.ReplicaJob`, "
            "`Supervisor._handle`, `Supervisor._handled`, `targets.current()`, "
            "`colab_xla.notebook.targets.run_cell`, `ReplicaJob`, `ReplicaJobs`, "
            "`sys._current_frames()`, `<name>.RUNTIME`, `job ...`\n")
    assert stale_citations(text, package_names) == [
        "job.py", "views/", "replica.execution.ReplicaJob", "Supervisor._handled", "ReplicaJobs"]


def test_what_the_architecture_page_cites_exists(package_names):
    stale = stale_citations(ARCHITECTURE.read_text(encoding="utf-8"), package_names)
    assert not stale, f"docs/architecture.md cites what the package does not have: {stale}"


def test_what_the_package_cites_of_itself_exists(package_names):
    """Every ``colab_xla.x.y`` a docstring or comment of the package names (a module, a
    class, a function, a member) is one the package has."""
    stale = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in re.finditer(r"\bcolab_xla(?:\.[A-Za-z_][A-Za-z0-9_]*)+", line):
                if not package_names.resolves(m.group(0)):
                    stale.append(f"{_name(path)}:{number}: {m.group(0)}")
    assert not stale, "the package cites what it does not have:\n" + "\n".join(stale)


def test_the_simulation_page_has_a_row_for_each_collective_the_conformance_tests_call():
    """docs/simulation.md's table of collectives names every ``xm.`` collective and every
    ``dist.`` op that tests/test_conformance.py runs on the simulations."""
    import test_conformance

    text = (ROOT / "docs" / "simulation.md").read_text()
    table = text[text.index("## Each collective on the simulation"):]
    table = table[:table.index("\n\n", table.index("| Collective"))]
    sources = " ".join([*test_conformance.BEHAVIOURS.values(),
                        *test_conformance.DISTRIBUTED.values(),
                        *(call for call, _ in test_conformance.ERRORS.values())])
    called = {f"`xm.{name}" for name in re.findall(r"\bxm\.(\w+)\(", sources)}
    called |= {f"`{name}" for name in re.findall(r"\bdist\.(\w+)\(", sources)
               if name not in ("get_rank", "get_world_size", "get_backend", "is_initialized")}
    missing = sorted(name + "`" for name in called if name not in table)
    assert not missing, f"docs/simulation.md's table of collectives lacks {missing}"
