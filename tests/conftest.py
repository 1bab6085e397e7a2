"""Fixtures shared by several test modules; the repository's tools/ on sys.path (the test
modules import ``run_notebooks`` from there, as they import helpers from tests/)."""

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
