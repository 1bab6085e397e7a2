"""What a session's replicas send outside any cell (colab_xla.notebook.targets.session_output):
the session's pipes read whenever no cell reads them, so a replica that prints between cells
never blocks, and its last lines kept for the message that it died (real pipes and a
writer process, no replicas)."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest

from colab_xla.notebook.pipes import RunPipes
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


@pytest.fixture
def pipes(tmp_path):
    made = RunPipes(str(tmp_path), 1)
    yield made
    made.close()


def test_a_replica_printing_many_times_a_pipe_between_cells_never_blocks(pipes):
    channel = SessionChannel(pipes)
    try:
        lines = 100_000  # ~3.5 MB: three times what the 1 MiB pipe holds
        writer = multiprocessing.get_context("fork").Process(
            target=_print_between_cells,
            args=(pipes.channel_path, pipes.startup_path, lines))
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


def test_printed_holds_what_was_written_before_it_though_the_reader_is_slow(pipes,
                                                                          monkeypatch):
    """What the pipes held when printed() was called is in its answer, however slowly the
    reader handles it (it did not wait for that: it looked whether the pipes were empty,
    and they are once the reader has read, before it has kept the lines; seen in CI's
    load, the last C-level line missing)."""
    def slow(handle):
        def handled_late(self, *args):
            time.sleep(0.05)  # (read from the pipe, not kept yet)
            handle(self, *args)
        return handled_late

    for name in ("_frame", "_c_output"):
        monkeypatch.setattr(SessionChannel, name, slow(getattr(SessionChannel, name)))
    channel = SessionChannel(pipes)
    try:
        for round_ in range(3):
            _write(pipes, f"python {round_}\n", f"c {round_}\nhalf {round_}")
            printed = channel.printed(settle=10)
            assert printed[-1] == f"[process 0] half {round_}", printed
            assert any(line.endswith(f"c {round_}") for line in printed)  # (after a half)
            assert f"[replica 0] python {round_}" in printed
    finally:
        channel.close()


def test_notes_wait_at_most_as_long_as_asked(pipes):
    channel = SessionChannel(pipes)
    try:
        assert channel.notes(0.05) == [] and channel.printed() == []
    finally:
        channel.close()


def _write(pipes: RunPipes, text: str, c_level: str) -> None:
    writer = frames.ChannelWriter(os.open(pipes.channel_path, os.O_WRONLY))
    writer.send(frames.STDOUT, 0, text.encode())
    fd = os.open(pipes.fd_paths[0][1], os.O_WRONLY)
    os.write(fd, c_level.encode())
    os.close(fd)
    os.close(writer.fd)


def test_a_lent_pipe_is_the_cells_alone_and_given_back_is_read_again(pipes):
    """What came before the cell took the pipes is the session's; what comes while the cell
    has them, the cell's alone (the session's reader neither takes nor sees it); after the
    cell gives them back, the session's again."""
    channel = SessionChannel(pipes)
    try:
        _write(pipes, "before the cell\n", "C before\n")
        lent = channel.lend()
        assert lent is pipes
        assert channel.printed(0) == ["[replica 0] before the cell", "[process 0] C before"]
        got, c_got = [], []
        pipes.begin(got.append, lambda fd, rank, kind, data: c_got.append((rank, data)))
        _write(pipes, "in the cell\n", "C in\n")
        pipes.read_held()
        assert [f.payload for f in got] == [b"in the cell\n"]
        assert c_got == [(0, b"C in\n")]
        pipes.end()
        channel.give_back()
        _write(pipes, "after the cell\n", "C after\n")
        for _ in range(100):
            printed = channel.printed()
            if len(printed) == 4:
                break
        assert printed == ["[replica 0] before the cell", "[process 0] C before",
                           "[replica 0] after the cell", "[process 0] C after"]
    finally:
        channel.close()
    channel.close()  # (again: nothing)
    assert channel.lend() is pipes  # closed: a cell may still take them


def reader_selects(monkeypatch, wanted):
    """An Event set once the session's reader calls select with file descriptors that
    ``wanted(fds)`` accepts (its select, seen from outside)."""
    import select as real_select
    import threading
    import types

    from colab_xla.notebook.targets import session_output

    seen = threading.Event()

    def select(fds, *rest):
        if wanted(fds):
            seen.set()
        return real_select.select(fds, *rest)

    monkeypatch.setattr(session_output, "select", types.SimpleNamespace(select=select))
    return seen


def test_pipes_given_back_are_read_again_unwoken_and_lent_again_without_a_wake(pipes,
                                                                            monkeypatch):
    """give_back writes nothing to the reader (it takes the pipes back at its next look,
    within _IDLE_SECONDS), and a cell that takes them again before that wakes it neither:
    what a replica sends after the cell reaches notes(), which does not wake the reader."""
    commands = []
    real_write = os.write
    # the reader's first look: its select takes in its control pipe and the session's pipes
    watching = reader_selects(monkeypatch, lambda fds: len(fds) > 1)

    def write(fd, data):
        if fd == channel._control_w:
            commands.append(bytes(data))
        return real_write(fd, data)

    channel = SessionChannel(pipes)
    monkeypatch.setattr(os, "write", write)
    try:
        assert watching.wait(10)
        channel.lend()
        assert commands == [b"l"]  # (the reader was watching the pipes: told)
        channel.give_back()
        channel.lend()  # taken again at once (cells one after another)
        channel.give_back()
        assert commands == [b"l"]
        writer = frames.ChannelWriter(os.open(pipes.channel_path, os.O_WRONLY))
        writer.send(frames.NOTE, 0, json.dumps({"after": 1}).encode())
        os.close(writer.fd)
        notes = channel.notes(5)
        assert notes == [{"after": 1, "ordinal": 0}]
        assert commands == [b"l"]
    finally:
        channel.close()


def test_pipes_given_back_while_the_reader_waits_without_them_are_read_again_unwoken(
        pipes, monkeypatch):
    """The reader, once it waits with the pipes lent (its select on its control pipe
    alone), takes them back by itself after give_back (which does not wake it)."""
    # its select on its control pipe alone
    waits_without_pipes = reader_selects(monkeypatch, lambda fds: len(fds) == 1)
    channel = SessionChannel(pipes)
    try:
        channel.lend()
        assert waits_without_pipes.wait(10)
        channel.give_back()
        writer = frames.ChannelWriter(os.open(pipes.channel_path, os.O_WRONLY))
        writer.send(frames.NOTE, 0, json.dumps({"after": 2}).encode())
        os.close(writer.fd)
        assert channel.notes(5) == [{"after": 2, "ordinal": 0}]
    finally:
        channel.close()


def test_a_cell_takes_the_pipes_without_waiting_for_the_reader_thread_to_wake(pipes,
                                                                            monkeypatch):
    """lend() reads what the pipes hold (the session's) in the cell's own thread and
    returns, however late the OS runs the reader thread (a round trip to it cost a warm
    cell 0.1-0.4 ms on 2 busy cores); that thread, once it runs, no longer reads them."""
    import select
    import threading

    asleep, woken = threading.Event(), threading.Event()
    real = select.select

    def late_reader(*args):
        if threading.current_thread().name == "colab_xla-session-output":
            asleep.set()
            woken.wait(30)  # (a reader thread the OS has not run yet)
        return real(*args)

    monkeypatch.setattr(select, "select", late_reader)
    channel = SessionChannel(pipes)
    try:
        assert asleep.wait(10)
        _write(pipes, "before the cell\n", "C before\n")
        lender = threading.Thread(target=channel.lend)
        lender.start()
        lender.join(10)
        assert not lender.is_alive()  # (it waited for the reader)
        assert channel.printed(0) == ["[replica 0] before the cell", "[process 0] C before"]
        woken.set()
        got = []
        pipes.begin(got.append, lambda *args: None)
        _write(pipes, "in the cell\n", "")
        pipes.read_until_empty(pipes.read_fd, 10)
        assert [f.payload for f in got] == [b"in the cell\n"]
        pipes.end()
        assert channel.printed(0) == ["[replica 0] before the cell", "[process 0] C before"]
    finally:
        woken.set()
        channel.close()


def test_a_reader_thread_that_saw_the_pipes_readable_before_a_whole_cell_does_not_block(
        pipes, monkeypatch):
    """The reader's select saw a pipe readable; before it read, a cell took the pipes, read
    them and gave them back (a reader thread the OS did not run for a whole warm cell).
    The pipe is empty now: the reader must not read it (a read of an empty pipe blocks, and
    held the pipes: the next cell waited for it, and its replicas for the next cell)."""
    import select
    import threading

    real, saw, go_on = select.select, threading.Event(), threading.Event()

    def reader_paused_after_select(*args):
        readable = real(*args)
        if (threading.current_thread().name == "colab_xla-session-output"
                and pipes.read_fd in readable[0] and not saw.is_set()):
            saw.set()
            go_on.wait(30)
        return readable

    monkeypatch.setattr(select, "select", reader_paused_after_select)
    channel = SessionChannel(pipes)
    try:
        _write(pipes, "between cells\n", "")
        assert saw.wait(10)  # the reader saw it, and has not read it
        channel.lend()  # a whole cell: what the pipes held is read, as the session's
        pipes.begin(lambda frame: None, lambda *args: None)
        pipes.end()
        channel.give_back()
        go_on.set()
        lender = threading.Thread(target=channel.lend)  # the next cell
        lender.start()
        lender.join(10)
        assert not lender.is_alive()  # (the reader blocked in a read, holding the pipes)
        assert channel.printed(0) == ["[replica 0] between cells"]
        channel.give_back()
    finally:
        go_on.set()
        channel.close()
