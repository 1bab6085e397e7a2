"""A replica's report on its way back (colab_xla.wire.values): in the end frame or a file."""

import os

import pytest

from colab_xla.wire import frames, values

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_a_small_report_travels_in_the_end_frame_and_a_large_one_in_its_file(tmp_path):
    from colab_xla.wire.reports import ReplicaReport

    small = ReplicaReport(ordinal=0, pid=1, elapsed=0.5, value_repr="1")
    sent = values.report_to_send(str(tmp_path), small)
    assert sent and not os.listdir(tmp_path)  # no file
    payload = values.end_payload(12.5, sent)
    assert values.ended_at(payload) == 12.5
    assert values.read_report(str(tmp_path), 0, values.sent_report(payload)) == small

    large = ReplicaReport(ordinal=3, pid=1, elapsed=0.5, value=b"x" * values.FRAME_REPORT_BYTES)
    assert values.report_to_send(str(tmp_path), large) == b""
    assert os.listdir(tmp_path) == ["report-3.pkl"]  # whole: no .tmp left
    payload = values.end_payload(1.0, b"")
    assert len(payload) + frames._HEADER.size <= frames.PIPE_BUF
    assert values.sent_report(payload) == b""
    assert values.read_report(str(tmp_path), 3, values.sent_report(payload)) == large
    assert values.ended_at(b"") is None  # (an end that says no time)
    larger = ReplicaReport(ordinal=4, pid=1, elapsed=0.5, pulled={
        "w": b"y" * (2 * values.FRAME_REPORT_BYTES)})  # (pickled straight into its file)
    assert values.report_to_send(str(tmp_path), larger) == b""
    assert values.read_report(str(tmp_path), 4) == larger
