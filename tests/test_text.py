"""The text view (colab_xla.notebook.views.text): every replica, its output, result and error."""

import pytest

from colab_xla.notebook.views import text as text_view
from test_outcome import _outcome_with_errors  # tests/ is on sys.path

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_text_view_shows_every_replica_its_output_result_and_error():
    text = text_view.render(_outcome_with_errors())
    assert text.splitlines()[0] == "4 replicas on CPU: 1 done, 3 failed in 0.50 s"
    for ordinal in range(4):
        assert f"── replica {ordinal} · " in text
    assert "hello 0\nOut: 0" in text
    assert text.count("ValueError: boom") == 2  # one line per failed replica
