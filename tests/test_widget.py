"""The widget view's bookkeeping (colab_xla.notebook.views.widget), never displayed."""

import pytest

from colab_xla.notebook.outcome import ReplicaOutcome, RunOutcome

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_combined_view_labels_lines_and_merges_identical_ones_across_replicas():
    from colab_xla.notebook.views.widget import WidgetView

    outcome = RunOutcome("CPU", {o: ReplicaOutcome(o) for o in range(3)})
    view = WidgetView()  # never displayed: only its bookkeeping is exercised
    for o in range(3):
        view.output(outcome, o, ["epoch 1 done"])
    view.output(outcome, 1, ["only me"])
    view.output(outcome, "process 0", ["from C"])
    view.output(outcome, 0, ["epoch 1 done"])  # a second time from replica 0: a new row
    assert view._combined_rows(outcome) == ["[all 3] epoch 1 done", "[replica 1] only me",
                                            "[process 0] from C", "[replica 0] epoch 1 done"]
