"""What a session's replicas send outside any cell (colab_xla.notebook.targets.session_output):
read all the time, so a replica that prints between cells never blocks, and its last lines
kept for the message that it died (real pipes and a writer process, no replicas)."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from colab_xla.notebook.targets.session_output import KEPT_LINES, SessionChannel
from colab_xla.wire import frames

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle"), pytest.mark.timeout(60)]


def _print_between_cells(channel_path: str, startup_path: str, lines: int) -> None:
    """A replica between cells: many lines of Python output (frames), C-level output on
    the startup pipe, then a note."""
    writer = frames.ChannelWriter(os.open(channel_path, os.O_WRONLY))
    for i in range(lines):
        writer.send(frames.STDOUT, 3, f"line {i} of a thread's chatter\n".encode())
    startup = os.open(startup_path, os.O_WRONLY)
    os.write(startup, b"a C library's warning\nand half a li")
    writer.send(frames.NOTE, 3, json.dumps({"ready": 42}).encode())
    os._exit(0)


def test_a_replica_printing_many_times_a_pipe_between_cells_never_blocks(tmp_path):
    channel = SessionChannel(str(tmp_path))
    try:
        lines = 100_000  # ~3.5 MB: three times what the 1 MiB pipe holds
        writer = multiprocessing.get_context("fork").Process(
            target=_print_between_cells,
            args=(channel.channel_path, channel.startup_path, lines))
        writer.start()
        writer.join(30)
        assert writer.exitcode == 0  # (None: it blocked on a full pipe)
        notes = []
        for _ in range(100):
            notes += channel.notes(0.2)
            if notes:
                break
        assert notes == [{"ready": 42, "ordinal": 3}]
        printed = channel.printed()
        assert printed[-1] == "and half a li"  # the unended line, last
        kept = [line for line in printed if line.startswith("[replica 3] ")]
        assert kept[-1] == f"[replica 3] line {lines - 1} of a thread's chatter"
        assert len(printed) <= KEPT_LINES + 1
    finally:
        channel.close()
    assert channel.notes(0) == []  # closed: nothing waits


def test_notes_wait_at_most_as_long_as_asked(tmp_path):
    channel = SessionChannel(str(tmp_path))
    try:
        assert channel.notes(0.05) == [] and channel.printed() == []
    finally:
        channel.close()
