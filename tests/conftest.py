"""Fixtures shared by several test modules."""

import tempfile

import pytest

from colab_xla import state


@pytest.fixture
def private_state(tmp_path, monkeypatch):
    """colab_xla's per-user state directory (registry, logs) in a test's own tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(state, "_state_dir", None)
    yield tmp_path
    monkeypatch.setattr(state, "_state_dir", None)
