"""The environment the tests run in is the one they claim, and pip leaves a runtime's pins alone.

``scripts/test`` runs the suite in the dev ``.venv`` and in each users' stack of ``stacks/``
(``.venv-colab``: Colab's pinned Jupyter on Python 3.13; ``.venv-kaggle``), with
``COLAB_XLA_STACK`` naming the stack. Two things would make such a run silently test the dev
stack instead: a kernelspec ``python3`` that starts another interpreter, and a stack file
whose pins the env does not hold. Both are checked here. The last tests run
``pip install --dry-run --report`` of this repository into the current env: installing
colab_xla must not replace the Jupyter stack or torch/torch_xla a runtime ships.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = [pytest.mark.stacks("colab", "kaggle", "torchtpu")]

REPO = Path(__file__).resolve().parent.parent
STACK = os.environ.get("COLAB_XLA_STACK", "")  # set by scripts/test for .venv-NAME

# What a `pip install colab_xla` must never install (upgrade, downgrade or reinstall) into
# Colab/Kaggle: the Jupyter stack google-colab pins, and the runtime's torch pair (or
# TorchTPU's torch, torch-tpu and libtpu).
PROTECTED = ("ipython", "ipykernel", "ipywidgets", "widgetsnbextension", "traitlets",
             "jupyter-client", "torch", "torch-xla", "torch-tpu", "libtpu")
# Versions the kernel must report, so a kernel of another env shows up as a mismatch.
REPORTED = ("ipython", "ipykernel", "ipywidgets", "traitlets", "jupyter-client", "torch",
            "torch-xla", "torch-tpu")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stack_pins(path: Path) -> dict:
    """``{canonical name: version}`` of the ``name==version`` lines of a stacks/ file."""
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s#;]+)", line)
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return pins


def installed_version(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def protected_changes(report: dict, protected=PROTECTED) -> list:
    """``["name version", ...]`` for each protected package a pip ``--report`` would install."""
    wanted = {canonical(p) for p in protected}
    return sorted(f"{item['metadata']['name']} {item['metadata']['version']}"
                  for item in report.get("install", [])
                  if canonical(item["metadata"]["name"]) in wanted)


# --- units ---------------------------------------------------------------------------------


def test_stack_pins_are_read_from_the_stack_files():
    colab = stack_pins(REPO / "stacks" / "colab.txt")
    assert colab["ipython"] == "7.34.0" and colab["ipywidgets"] == "7.7.1"
    assert colab["jupyter-client"] == "7.4.9" and colab["torch-xla"] == "2.9.0"
    assert "pytest" not in colab  # test tools are not pinned there: they follow the pins
    kaggle = stack_pins(REPO / "stacks" / "kaggle.txt")
    assert kaggle == {"torch": "2.8.0", "torch-xla": "2.8.0"}


def _report(*installs):
    return {"version": "1", "install": [
        {"metadata": {"name": n, "version": v}, "requested": False} for n, v in installs]}


def test_a_report_that_replaces_a_pinned_package_fails_the_check():
    assert protected_changes(_report(("cloudpickle", "3.1.1"))) == []
    assert protected_changes(_report(("ipywidgets", "8.1.7"), ("comm", "0.2.3"),
                                     ("widgetsnbextension", "4.0.14"))) == [
        "ipywidgets 8.1.7", "widgetsnbextension 4.0.14"]
    assert protected_changes(_report(("IPython", "9.0.0"), ("Jupyter_Client", "8.6.3"),
                                     ("torch_xla", "2.9.0"))) == [
        "IPython 9.0.0", "Jupyter_Client 8.6.3", "torch_xla 2.9.0"]


# --- the env and its kernels ------------------------------------------------------------------


def test_this_env_holds_its_stacks_pins():
    if not STACK:
        pytest.skip("dev env (.venv): no stack named by COLAB_XLA_STACK")
    assert Path(sys.prefix).resolve() == (REPO / f".venv-{STACK}").resolve()
    pins = stack_pins(REPO / "stacks" / f"{STACK}.txt")
    have = {name: installed_version(name) for name in pins}
    assert have == pins
    python = re.search(r"^# python: *(\S+)", (REPO / "stacks" / f"{STACK}.txt").read_text(), re.M)
    assert "%d.%d" % sys.version_info[:2] == python.group(1)


@pytest.mark.skipif(not Path(tempfile.gettempdir()).name.startswith("colab_xla-tests-"),
                    reason="run by hand, not by scripts/test (which unsets the variable)")
def test_the_processes_of_a_test_run_write_their_bytecode():
    # scripts/env compiles no .pyc at install: the first process that imports a module
    # writes it. With PYTHONDONTWRITEBYTECODE set (these machines set it), every kernel,
    # replica and forkserver would compile torch's sources again: nothing else would fail,
    # the run would only be slower.
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ and not sys.dont_write_bytecode


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_kernels_the_tests_start_are_this_envs_python():
    """The kernel nbclient starts by the name the tests and run_notebooks use ("python3") runs
    this env's interpreter with this env's IPython/ipykernel/ipywidgets/torch_xla."""
    import nbformat

    import run_notebooks  # tools/ is on sys.path (conftest.py)

    probe = ("import json, sys\nfrom importlib import metadata\n"
             f"names = {list(REPORTED)!r}\n"
             "def version(name):\n"
             "    try:\n        return metadata.version(name)\n"
             "    except metadata.PackageNotFoundError:\n        return None\n"
             "print(json.dumps({'prefix': sys.prefix, 'version': list(sys.version_info[:3]),\n"
             "    'packages': {n: version(n) for n in names}}))")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(probe)])
    run_notebooks.execute(nb, timeout=120)  # nbclient, kernel "python3", env kernel_env()
    [out] = [o for o in nb.cells[0].outputs if o.output_type == "stream"]
    kernel = json.loads(out.text)
    assert Path(kernel["prefix"]).resolve() == Path(sys.prefix).resolve(), kernel
    assert kernel["version"] == list(sys.version_info[:3])
    assert kernel["packages"] == {n: installed_version(n) for n in REPORTED}
    if STACK:
        pins = stack_pins(REPO / "stacks" / f"{STACK}.txt")
        assert {n: v for n, v in kernel["packages"].items() if n in pins} == {
            n: v for n, v in pins.items() if n in REPORTED}


# --- pip and the pins ---------------------------------------------------------------------------


@pytest.mark.pip
@pytest.mark.timeout(300)
def test_pip_install_of_this_repo_leaves_the_runtime_stack_alone(tmp_path):
    """What `pip install <checkout>` would do to this env: colab_xla's install_requires are
    resolved against what is installed, and none of the protected packages may move."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                           "--report", str(report), str(REPO)],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(report.read_text())
    installs = [item["metadata"]["name"] for item in data["install"]]
    assert "colab_xla" in [canonical(n).replace("-", "_") for n in installs]  # it did resolve
    assert protected_changes(data) == [], installs
