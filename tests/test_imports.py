"""What importing colab_xla pulls in: the core without IPython, the text view without the
runtime."""

import pytest

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_the_core_imports_without_ipython_and_the_text_view_without_the_runtime():
    # What README and docs/architecture.md say: only magics.py and views/widget.py need
    # IPython; the text view (a pure renderer) pulls in neither the run loop nor torch.
    import subprocess
    import sys

    code = """
import importlib, pkgutil, sys
sys.modules["IPython"] = sys.modules["ipywidgets"] = None  # importing them fails
import colab_xla.notebook.views.text
loaded = {"colab_xla.notebook.supervisor", "colab_xla.notebook.targets", "torch"} & set(sys.modules)
assert not loaded, sorted(sys.modules)
import colab_xla
for info in pkgutil.walk_packages(colab_xla.__path__, "colab_xla."):
    if info.name not in ("colab_xla.notebook.magics", "colab_xla.notebook.views.widget"):
        importlib.import_module(info.name)
import colab_xla.notebook.targets  # run_cell, the targets (colab_xla.notebook: no __init__)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
