"""``%%xla_spawn`` in a real ipykernel driven by nbclient: what a saved notebook holds."""

import json
import os
import re

import nbformat
import pytest

import run_notebooks  # tools/ is on sys.path (conftest.py)
from _kernel import Kernel, shell_msg_ready  # tests/ is on sys.path

from colab_xla.notebook.outcome import INTERRUPTED

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(300), pytest.mark.stacks("colab")]

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
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


def widget_models(nb, cell=None):
    """The saved widget models by id: the notebook's, or only those ``cell``'s displays
    draw (its view's models and every model they refer to, ``IPY_MODEL_<id>``)."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    if cell is None:
        return dict(state)
    todo = [o["data"][WIDGET_VIEW]["model_id"] for o in cell.outputs
            if o.output_type == "display_data" and WIDGET_VIEW in o["data"]]
    drawn = {}
    while todo:
        model_id = todo.pop()
        if model_id in drawn or model_id not in state:
            continue
        drawn[model_id] = state[model_id]
        todo += re.findall(r"IPY_MODEL_(\w+)", json.dumps(state[model_id]["state"]))
    return drawn


def tab_titles(state):
    """A Tab's titles: a list on ipywidgets 8, ``{"0": ...}`` in ``_titles`` on 7 (Colab)."""
    if "titles" in state:
        return list(state["titles"])
    return [title for _, title in sorted(state["_titles"].items(), key=lambda kv: int(kv[0]))]


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


def test_widget_state_and_static_summary_are_saved_in_the_cell(notebook):
    nb = notebook
    magic, after = nb.cells[1], nb.cells[2]
    displays = [o for o in magic.outputs if o.output_type == "display_data"]
    assert len(displays) == 1  # one display, updated in place to its final form
    data = displays[0]["data"]
    # The saved summary: readable without any widget state.
    assert "3 replicas on CPU: 2 done, 1 failed" in data["text/plain"]
    for o in range(3):
        assert f"── replica {o} · " in data["text/plain"] and f"hello {o}" in data["text/plain"]
    assert "Out: 2" in data["text/plain"] and "ValueError: replica two fails" in data["text/plain"]
    assert "<table>" in data["text/html"] and "replica two fails" in data["text/html"]
    # The live widget's final model state.
    models = widget_models(nb, magic)
    assert data[WIDGET_VIEW]["model_id"] in models
    tabs = [m["state"] for m in models.values() if m["model_name"] == "TabModel"]
    assert tabs and tab_titles(tabs[0]) == ["all", "0 ✓", "1 ✓", "2 ✗"]
    outputs = {tuple(o["text"] for o in m["state"]["outputs"]) for m in models.values()
               if m["model_name"] == "OutputModel" and m["state"]["outputs"]}
    for o in range(3):  # each replica's own tab, with its C-level line (a process each)
        own = ["".join(texts) for texts in outputs if f"hello {o}\n" in "".join(texts)
               and "[replica" not in "".join(texts)]
        assert own and sorted(own[0].splitlines()) == ["from C", f"hello {o}"], (o, outputs)
    combined = [t for texts in outputs for t in texts if "[replica 0] hello 0" in t]
    assert combined and all(f"[replica {o}] hello {o}" in combined[0] for o in range(3))
    assert "from C" in combined[0]
    htmls = " ".join(m["state"].get("value", "") for m in models.values()
                     if m["model_name"] == "HTMLModel")
    assert "failed: replica 2" in htmls and "Cell In[2], line 6" in htmls
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
