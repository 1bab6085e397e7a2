"""Fixtures shared by several test modules; the repository's tools/ on sys.path (the test
modules import ``run_notebooks`` from there, as they import helpers from tests/)."""

import signal
import sys
import tempfile
from pathlib import Path

import pytest

from colab_xla.notebook import state

TOOLS = str(Path(__file__).resolve().parents[1] / "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)


@pytest.fixture
def private_state(tmp_path, monkeypatch):
    """colab_xla's per-user state directory (registry, logs) in a test's own tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(state, "_state_dir", None)
    yield tmp_path
    monkeypatch.setattr(state, "_state_dir", None)


@pytest.fixture
def two_users():
    """Two fresh Unix users sharing a private /tmp and /dev/shm (tests/_two_users.py), for
    one test: what one test planted or left is not the next one's."""
    from _two_users import SharedMachine, why_not

    reason = why_not()
    if reason:
        pytest.skip(f"the shared-machine layer {reason}")
    machine = SharedMachine()
    try:
        yield machine
    finally:
        machine.close()


# --- which tests a users' stack runs ---------------------------------------------------------
# The dev env runs every test; a users' stack of stacks/ (scripts/test passes --users-stack
# NAME there) runs only those that its versions change: the tests whose closest
# ``stacks(...)`` marker names it. Closest: a test's own marker (or its parameter's) over its
# module's, so ``@pytest.mark.stacks()`` keeps one test of a module that runs in the stacks in
# dev alone. scripts/test's header says what each stack runs and why.

STACKS_DIR = Path(__file__).resolve().parents[1] / "stacks"


def pytest_addoption(parser):
    parser.addoption("--users-stack", metavar="NAME", default="",
                     help="run only the tests marked stacks(..., NAME, ...) (a stack of stacks/)")


def pytest_configure(config):
    # The tests interrupt as Jupyter does, and a kernel takes SIGINT as KeyboardInterrupt
    # while it runs a cell; a shell that starts a command in the background without job
    # control (`cmd &` in a script) makes it ignore SIGINT, and every process the tests
    # start then inherited that: a fresh child's Python left it ignored, and tests whose
    # processes rely on Python's own handler (no handler of colab_xla's) waited for an
    # interrupt that never came. Taken back here, in the controller and in each worker.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    name = config.getoption("--users-stack")
    if name and not (STACKS_DIR / f"{name}.txt").is_file():
        known = sorted(p.stem for p in STACKS_DIR.glob("*.txt"))
        raise pytest.UsageError(f"--users-stack {name}: no stacks/{name}.txt (stacks: {known})")


# --- running in parallel (pytest-xdist, as scripts/test runs every env) ----------------------
# Each module's tests run in one worker (its module-scoped fixtures are made once), but the
# modules that start a local Ray cluster share one worker: two clusters starting at once on
# two cores time out (and Ray's dashboard port is one per machine).
RAY_MODULES = {"test_cluster", "test_cluster_faults", "test_cluster_tpu", "test_cluster_tutorial",
               "test_shared_machine_ray"}
# Modules without module-scoped fixtures whose tests are long and independent: each test a
# group of its own, so both workers share them (TorchTPU's: a child process or two each).
SPREAD_MODULES = {"test_torch_tpu"}


def _group(item) -> str:
    """The module, or "ray" for a test that starts a local Ray cluster (the cluster
    modules', and the cluster benchmark's smoke test), or the test itself for a module of
    :data:`SPREAD_MODULES`."""
    module = item.path.stem
    if module in RAY_MODULES or (module == "test_bench" and "cluster.py" in item.nodeid):
        return "ray"
    if module in SPREAD_MODULES:
        return f"{module}.{item.name}"
    return module


def _group_for_workers(items) -> None:
    """Each item's group, as xdist's loadgroup reads it: a ``@group`` suffix of its node id.
    (xdist 3.8 writes that suffix to ``item._nodeid``, which pytest 9 no longer reads: its
    node ids are ``item._id``. So the suffix is written here, where xdist would.)"""
    from _pytest.nodeid import coerce_node_id

    for item in items:
        group = _group(item)
        if hasattr(item, "_id"):
            item._id = coerce_node_id(f"{item.nodeid}@{group}")
        else:  # pytest 8 and older: xdist's own way (the marker)
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its own hook, in each worker)
def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):  # a worker of --dist loadgroup
        _group_for_workers(items)
    name = config.getoption("--users-stack")
    if not name:
        return
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("stacks")
        (keep if marker is not None and name in marker.args else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

