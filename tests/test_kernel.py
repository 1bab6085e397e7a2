"""``%%xla_spawn`` in a real ipykernel driven by nbclient: what a saved notebook holds."""

import os
import re

import nbformat
import pytest

import run_notebooks  # tools/ is on sys.path (conftest.py)
from _kernel import Kernel, shell_msg_ready  # tests/ is on sys.path

from colab_xla.notebook.outcome import INTERRUPTED

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(300), pytest.mark.stacks("colab")]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def execute(*sources, env=None):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in ("%load_ext colab_xla",) + sources]
    # ipykernel turns its fd capture off when it sees PYTEST_CURRENT_TEST.
    kernel_env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    kernel_env.update(env or {})
    run_notebooks.execute(nb, env=kernel_env, timeout=240, allow_errors=True,
                          store_widget_state=True)
    return nb


def stream_text(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


CELL = """%%xla_spawn -n 3 -o r
import ctypes
print("hello", index)
ctypes.CDLL(None).printf(b"from C\\n")
if index == 2:
    raise ValueError("replica two fails")
index * 2"""


TEXT_CELL = "%%xla_spawn -n 2 --no-widget\nprint('line from', index)\nindex"


@pytest.fixture(scope="module")
def notebook():
    """The two tests' cells, run in one kernel one after another (as a user would)."""
    return execute(CELL, "print('next cell', r)", TEXT_CELL)


def test_the_cell_ends_as_its_static_form_readable_without_widget_state(notebook):
    """Issue 55: the saved display named the widget beside its summary, so JupyterLab drew
    "Error displaying widget: model not found" once the kernel was gone. What stays is the
    static form: each replica's own output (its C-level line too), result and error."""
    nb = notebook
    magic, after = nb.cells[1], nb.cells[2]
    displays = [o for o in magic.outputs if o.output_type == "display_data"]
    assert len(displays) == 1  # one display, updated in place to its final form
    data = displays[0]["data"]
    assert set(data) == {"text/plain", "text/html"}, set(data)  # no widget view
    assert "3 replicas on CPU: 2 done, 1 failed" in data["text/plain"]
    for o in range(3):
        assert f"── replica {o} · " in data["text/plain"] and f"hello {o}" in data["text/plain"]
    assert "Out: 2" in data["text/plain"] and "ValueError: replica two fails" in data["text/plain"]
    page = data["text/html"]
    assert "failed: replica 2" in page
    sections = page.split("<details")[1:]
    assert [s.split("</b>")[0].rsplit(" ", 1)[-1] for s in sections] == ["2", "0", "1"]
    for o, section in zip((2, 0, 1), sections):  # each replica's own lines, from C too
        lines = section.split("<pre")[1].split(">", 1)[1].split("</pre>")[0].splitlines()
        assert sorted(lines) == ["from C", f"hello {o}"], (o, section)
    assert "Out: 2" in sections[2] and "Cell In[2], line 6" in sections[0]
    assert "ValueError: replica two fails" in sections[0]
    # The error stops Run All, and nothing leaks into the next cell.
    assert [o.ename for o in magic.outputs if o.output_type == "error"] == ["XlaSpawnError"]
    assert stream_text(after) == "next cell {0: 0, 1: 2}\n"


def test_text_view_streams_lines_labelled_by_replica(notebook):
    cell = notebook.cells[3]
    text = stream_text(cell)
    assert "[replica 0] line from 0" in text and "[replica 1] line from 1" in text
    assert "2 replicas on CPU: 2 done" in text and "Out: 1" in text
    assert not [o for o in cell.outputs if o.output_type == "display_data"]


def test_environment_selects_the_text_view():
    nb = execute("%%xla_spawn -n 1\nprint('plain')", env={"COLAB_XLA_VIEW": "text"})
    assert "[replica 0] plain" in stream_text(nb.cells[1])


def test_twenty_interrupts_leave_no_process_and_the_kernel_stays_usable(tmp_path):
    import time

    import psutil

    with Kernel() as k:
        # first=True: each reply is the next one the kernel sends, not merely one that came.
        assert k.run("%load_ext colab_xla", timeout=120, first=True).status == "ok"
        cell = ("%%xla_spawn -n 2 --no-widget\nimport os, time\nprint('started', index)\n"
                f"open({str(tmp_path)!r} + f'/pid{{index}}', 'w').write(str(os.getpid()))\n"
                "time.sleep(600)")
        for cycle in range(20):
            files = [tmp_path / "pid0", tmp_path / "pid1"]
            # submit() sends stop_on_error=False: the previous cell ended in an error (the
            # interrupt), and ipykernel aborts requests that arrive right after one (that is
            # Run All stopping).
            msg_id = k.submit(cell)
            deadline = time.monotonic() + 120
            while not all(f.exists() and f.read_text() for f in files):
                assert time.monotonic() < deadline, f"cycle {cycle}: replicas did not start"
                if shell_msg_ready(k.kc):  # the cell ended before its replicas ran
                    reply = k.wait(msg_id, 30, first=True)
                    pytest.fail(f"cycle {cycle}: the cell ended before its replicas ran: "
                                f"{reply.status} {reply.ename}: {reply.evalue}\n"
                                + "\n".join(reply.traceback) + reply.stdout)
                time.sleep(0.05)
            pids = {int(f.read_text()) for f in files}
            k.interrupt()
            reply = k.reply(msg_id, 30, first=True)  # answered, not hung
            assert reply.status == "error"
            assert reply.ename == "KeyboardInterrupt"
            # one line, not IPython's traceback of the magic's frames (~20 ms of the reply)
            assert reply.traceback == [INTERRUPTED], reply.traceback
            # Every process the run started is gone by the time the cell has ended.
            assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                           for p in pids), f"cycle {cycle}: replica left behind"
            if cycle == 0:
                text = k.outputs(msg_id, reply, 30).stdout
                for o in range(2):
                    assert f"── replica {o} · stopped" in text
                    assert re.search(r"interrupted while running; at line \d+: `[^`]+`; "
                                     rf"last output: 'started {o}'", text), text
            for f in files:
                f.unlink()
        # No replica, no pool process (these cells use no `lock`: no Manager either).
        leftovers = [p for p in k.process.children(recursive=True) if p.status() != "zombie"]
        assert leftovers == [], [(p.pid, p.cmdline()) for p in leftovers]
        assert k.run("%%xla_spawn -n 2 -o r\nindex", 120, first=True).status == "ok"
        assert k.run("assert r == {0: 0, 1: 1}", 120, first=True).status == "ok"
