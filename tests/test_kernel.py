"""``%%xla_spawn`` in a real ipykernel driven by nbclient: what a saved notebook holds."""

import os

import nbformat
import pytest

import run_notebooks  # tools/ is on sys.path (conftest.py)
from _kernel import shell_msg_ready  # tests/ is on sys.path

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(300)]

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


def widget_models(nb):
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    return {model_id: m for model_id, m in state.items()}


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


def test_widget_state_and_static_summary_are_saved_in_the_cell():
    nb = execute(CELL, "print('next cell', r)")
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
    models = widget_models(nb)
    assert data[WIDGET_VIEW]["model_id"] in models
    tabs = [m["state"] for m in models.values() if m["model_name"] == "TabModel"]
    assert tabs and tab_titles(tabs[0]) == ["all", "0 ✓", "1 ✓", "2 ✗"]
    outputs = {tuple(o["text"] for o in m["state"]["outputs"]) for m in models.values()
               if m["model_name"] == "OutputModel" and m["state"]["outputs"]}
    for o in range(3):
        assert (f"hello {o}\n",) in outputs  # each replica's own tab
    combined = [t for texts in outputs for t in texts if "[replica 0] hello 0" in t]
    assert combined and all(f"[replica {o}] hello {o}" in combined[0] for o in range(3))
    assert "[process 0] from C" in combined[0]
    htmls = " ".join(m["state"].get("value", "") for m in models.values()
                     if m["model_name"] == "HTMLModel")
    assert "failed: replica 2" in htmls and "Cell In[2], line 6" in htmls
    # The error stops Run All, and nothing leaks into the next cell.
    assert [o.ename for o in magic.outputs if o.output_type == "error"] == ["XlaSpawnError"]
    assert stream_text(after) == "next cell {0: 0, 1: 2}\n"


def test_text_view_streams_lines_labelled_by_replica():
    nb = execute("%%xla_spawn -n 2 --no-widget\nprint('line from', index)\nindex")
    text = stream_text(nb.cells[1])
    assert "[replica 0] line from 0" in text and "[replica 1] line from 1" in text
    assert "2 replicas on CPU: 2 done" in text and "Out: 1" in text
    assert not [o for o in nb.cells[1].outputs if o.output_type == "display_data"]


def test_environment_selects_the_text_view():
    nb = execute("%%xla_spawn -n 1\nprint('plain')", env={"COLAB_XLA_VIEW": "text"})
    assert "[replica 0] plain" in stream_text(nb.cells[1])


def test_twenty_interrupts_leave_no_process_and_the_kernel_stays_usable(tmp_path):
    import time

    import psutil
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"})
    kc = km.client()
    kc.start_channels()
    kernel = psutil.Process(km.provisioner.process.pid)

    def shell_reply(timeout):
        # wait_for_ready asks kernel_info again each second the kernel is not ready: the
        # replies to the extra requests arrive later, before the first execute_reply.
        while True:
            msg = kc.get_shell_msg(timeout=timeout)
            if msg["msg_type"] != "kernel_info_reply":
                return msg

    def run(code, timeout=120):
        msg_id = kc.execute(code)
        reply = shell_reply(timeout)
        assert reply["parent_header"]["msg_id"] == msg_id
        return reply["content"]

    def stream_of(msg_id):
        text = []
        while True:
            msg = kc.get_iopub_msg(timeout=30)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                text.append(msg["content"]["text"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(text)

    try:
        kc.wait_for_ready(timeout=120)
        assert run("%load_ext colab_xla")["status"] == "ok"
        cell = ("%%xla_spawn -n 2 --no-widget\nimport os, time\nprint('started', index)\n"
                f"open({str(tmp_path)!r} + f'/pid{{index}}', 'w').write(str(os.getpid()))\n"
                "time.sleep(600)")
        for cycle in range(20):
            files = [tmp_path / "pid0", tmp_path / "pid1"]
            # stop_on_error=False: the previous cell ended in an error (the interrupt), and
            # ipykernel aborts requests that arrive right after one (that is Run All stopping).
            msg_id = kc.execute(cell, stop_on_error=False)
            deadline = time.monotonic() + 120
            while not all(f.exists() and f.read_text() for f in files):
                assert time.monotonic() < deadline, f"cycle {cycle}: replicas did not start"
                if shell_msg_ready(kc):  # the cell ended before its replicas ran
                    msg = shell_reply(1)
                    reply = msg["content"]
                    pytest.fail(f"cycle {cycle}: {msg['msg_type']} for "
                                f"{msg['parent_header'].get('msg_id') == msg_id and 'this cell'}: "
                                f"{reply.get('status')} {reply.get('ename')}: {reply.get('evalue')}"
                                f"\n" + "\n".join(reply.get("traceback", [])) + stream_of(msg_id))
                time.sleep(0.05)
            pids = {int(f.read_text()) for f in files}
            km.interrupt_kernel()
            reply = shell_reply(30)  # answered, not hung
            assert reply["parent_header"]["msg_id"] == msg_id
            assert reply["content"]["status"] == "error"
            assert reply["content"]["ename"] == "KeyboardInterrupt"
            # Every process the run started is gone by the time the cell has ended.
            assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                           for p in pids), f"cycle {cycle}: replica left behind"
            if cycle == 0:
                text = stream_of(msg_id)
                for o in range(2):
                    assert f"── replica {o} · killed" in text
                    assert f"interrupted while running; last output: 'started {o}'" in text
            for f in files:
                f.unlink()
        # No replica, no pool process (these cells use no `lock`: no Manager either).
        leftovers = [p for p in kernel.children(recursive=True) if p.status() != "zombie"]
        assert leftovers == [], [(p.pid, p.cmdline()) for p in leftovers]
        assert run("%%xla_spawn -n 2 -o r\nindex")["status"] == "ok"
        assert run("assert r == {0: 0, 1: 1}")["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
