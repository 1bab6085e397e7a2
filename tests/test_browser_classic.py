"""The live widget under ipywidgets 7, as Colab's stack has it: the classic Notebook (6.5) in
headless chromium runs a ``%%xla_spawn -n 4`` cell with one failing replica; the widget
shows the header, the "all" tab and one tab per replica with its mark, output, result and
traceback, and the cell ends with an XlaSpawnError. Colab's own frontend cannot run here;
the classic Notebook with the widgets nbextension is the ipywidgets 7 frontend that can.

Runs in the ``colab`` stack (``scripts/test`` runs it there with ``-m browser_classic``),
whose kernels have IPython 7.34, ipykernel 6.17.1 and ipywidgets 7.7.1. The frontend is
widgetsnbextension 3.6.1, the release made with ipywidgets 7.7.1, from the directory that
``scripts/env --stack colab`` fills (``$COLAB_XLA_CLASSIC_FRONTEND``): the 3.6.10 that Colab's
image pins (and never serves: Colab draws widgets itself) cannot create ipywidgets 7.7.1's
Output model in this frontend ("_deserialize_state is not a function"), whoever made the
widget. A full-page screenshot is left in ``test-artifacts/widget-classic.png``, and the page's
console and kernel messages with the output areas' DOM in ``test-artifacts/widget-classic-log.txt``.

A missing piece (torch_xla, chromium, playwright, ipywidgets 7, the frontend directory) is a
failure that says how to get it, not a skip, as in tests/test_browser.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Optional

import pytest

import _jupyterlab as lab  # tests/ is on sys.path (rootdir-relative import mode)
from test_browser import (FAILING, REPLICAS, SPAWN_AT, check_plots_and_bars, check_warm_up,
                          require_browser_stack, show_tab, tab_labels, write_notebook)

pytestmark = [pytest.mark.stacks("colab")]

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
RUN_TIMEOUT = 180  # s, from Run All to a finished widget
FRONTEND_VAR = "COLAB_XLA_CLASSIC_FRONTEND"

_CONNECTED_JS = ("() => !!(window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel"
                 " && Jupyter.notebook.kernel.is_connected())")
# A comm_info round trip of our own, on the shell channel, after the widget manager's.
_COMM_INFO_JS = ("() => new Promise(done =>"
                 " Jupyter.notebook.kernel.comm_info('jupyter.widget', () => done(true)))")
MANAGER_TIMEOUT = 60  # s, from a connected kernel to the widget manager's comm_info_request


@pytest.mark.browser_classic
@pytest.mark.timeout(300)
def test_widget_in_the_classic_notebook_under_ipywidgets_7(tmp_path):
    import ipywidgets

    sync_playwright = require_browser_stack()
    from run_notebooks import kernel_env  # tools/ is on sys.path (conftest.py)

    assert ipywidgets.__version__.startswith("7."), (
        f"this test is for ipywidgets 7 (Colab's); this stack has {ipywidgets.__version__}")
    frontend = os.environ.get(FRONTEND_VAR)
    assert frontend and Path(frontend, "share", "jupyter", "nbextensions").is_dir(), (
        f"${FRONTEND_VAR} must name the widget frontend that `scripts/env --stack colab` "
        f"installs (got {frontend!r})")
    root = tmp_path / "root"
    root.mkdir()
    write_notebook(root / "widget.ipynb")
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "widget-classic.png"
    screenshot.unlink(missing_ok=True)

    server = lab.ClassicNotebookServer(root, tmp_path / "state", kernel_env(),
                                       frontend_dir=Path(frontend))
    with _started(server), sync_playwright() as pw:
        browser = lab.launch_chromium(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.set_default_timeout(30_000)
        # Evidence for a failure, left in test-artifacts/widget-classic-log.txt: the page's
        # console (every type) and the kernel messages in the order the page saw them.
        console_errors, evidence, sent = [], [], []
        page.on("console", lambda m: (evidence.append(f"console.{m.type}: {m.text[:500]}"),
                                      m.type == "error" and console_errors.append(m.text)))

        def watch(ws):
            ws.on("framereceived", lambda frame: evidence.append("<- " + _describe_frame(frame)))
            ws.on("framesent", lambda frame: (evidence.append("-> " + _describe_frame(frame)),
                                              sent.append(_msg_type(frame))))

        page.on("websocket", watch)
        try:
            page.goto(f"{server.url}/notebooks/widget.ipynb?token={server.token}",
                      wait_until="domcontentloaded")
            page.wait_for_function(_CONNECTED_JS, timeout=120_000, polling=200)
            # The widget manager restores the kernel's widgets once the kernel is connected
            # (jupyter.widget.control, which ipywidgets 7.7 lacks, then comm_info_request), and
            # then re-renders every cell that shows a widget: it clears the cell's output (the
            # views are removed, which blanks the shown data's model_id) and redraws it from
            # its JSON without display ids. A cell that ran before that restore ended keeps a
            # hidden widget and drops the run's closing update_display_data ("No targets for
            # display_id"). A person opening a notebook waits that long; the test waits until
            # the manager has asked for the kernel's comms, then for an answer to a comm_info
            # request of its own: the shell channel answers in order, so the manager's came first.
            # (page.evaluate: the sync API delivers the websocket's events during its calls)
            lab.wait_until(lambda: page.evaluate("() => true") and "comm_info_request" in sent,
                           MANAGER_TIMEOUT, what="the widget manager's comm_info_request")
            page.evaluate(_COMM_INFO_JS)
            page.evaluate("() => Jupyter.notebook.execute_all_cells()")

            cells = page.locator("#notebook .cell.code_cell")
            spawn = cells.nth(SPAWN_AT)
            widget = spawn.locator(".widget-tab")

            def finished():
                """The tab titles, once the cell has ended (its error is shown: the closing
                draw came before it) and the redrawn widget has titled every tab (ipywidgets
                7 titles a new tab a moment after drawing it); else None."""
                if spawn.locator(".output_error").count() == 0 or widget.count() != 1:
                    return None
                labels = tab_labels(widget)
                done = (len(labels) == REPLICAS + 1 and all(labels)
                        and not any("▶" in t for t in labels))
                return labels if done else None

            def state():
                return (f"a finished widget (widgets: {widget.count()}; cell text: "
                        f"{spawn.inner_text()[-2000:]!r}; console errors: {console_errors[:5]}; "
                        f"server log: {server.log_tail(2000)}; kernel messages and console: "
                        f"test-artifacts/widget-classic-log.txt)")

            labels = lab.wait_until(finished, RUN_TIMEOUT, what=state)
            assert labels == ["all", "0 ✓", "1 ✓", "2 ✗", "3 ✓"]

            header = spawn.locator(".widget-html-content").first.inner_text()
            assert f"{REPLICAS} replicas" in header and f"failed: replica {FAILING}" in header

            combined = show_tab(widget, "all")
            for i in range(REPLICAS):
                assert f"[replica {i}] hello from {i}" in combined, combined
            assert "warm-up" not in combined, combined  # (its widgets are a retired run's)
            ok = show_tab(widget, "1 ✓")
            assert "hello from 1" in ok and "Out: 10" in ok and "hello from 2" not in ok, ok
            assert "warm-up" not in ok, ok
            check_plots_and_bars(widget, "classic-ipywidgets7")
            failed = show_tab(widget, "2 ✗")
            assert "ValueError: replica two fails" in failed and "Cell In[" in failed, failed
            assert re.search(rf"replica {FAILING} · failed", failed), failed

            check_warm_up(cells.nth(1))
            error = spawn.locator(".output_error").all_inner_texts()
            assert any("XlaSpawnError" in e for e in error), spawn.inner_text()
            assert not [e for e in console_errors if "model" in e.lower()], console_errors
        finally:
            try:
                dom = page.evaluate("() => Array.from(document.querySelectorAll("
                                    "'#notebook .cell.code_cell .output')).map(e => e.outerHTML)"
                                    ".join('\\n\\n')")
                (ARTIFACTS / "widget-classic-log.txt").write_text(
                    "\n".join(evidence) + "\n\nthe cells' output areas:\n" + dom)
                page.screenshot(path=str(screenshot), full_page=True)
            finally:
                browser.close()


def _message(payload) -> Optional[dict]:
    """A kernel message the page sent or received over its websocket (JSON; None for a
    binary one, which only carries widget buffers)."""
    if not isinstance(payload, str):
        return None
    with contextlib.suppress(ValueError):
        msg = json.loads(payload)
        return msg if isinstance(msg, dict) else None
    return None


def _msg_type(payload) -> Optional[str]:
    msg = _message(payload) or {}
    return msg.get("msg_type") or msg.get("header", {}).get("msg_type")


def _describe_frame(payload) -> str:
    """One line for the evidence log: channel, message type and what identifies it."""
    msg = _message(payload)
    if msg is None:
        return f"{type(payload).__name__} frame of {len(payload)}"
    c = msg.get("content") or {}
    t = _msg_type(payload)
    detail = {k: c[k] for k in ("comm_id", "target_name", "execution_state", "name") if k in c}
    if "data" in c and isinstance(c["data"], dict):
        d = c["data"]
        detail["data"] = ({k: (v if "widget" in k else str(v)[:60]) for k, v in d.items()}
                          if t in ("display_data", "update_display_data", "execute_result")
                          else {"method": d.get("method"),
                                "state": sorted((d.get("state") or {}))[:8]})
    if "transient" in c:
        detail["transient"] = c["transient"]
    if t == "stream":
        detail["text"] = c.get("text", "")[:80]
    if t == "error":
        detail["ename"] = c.get("ename")
    return f"{msg.get('channel')} {t} {detail}"


class _started:
    """``with``: the server, started, and stopped (its whole process group) afterwards."""

    def __init__(self, server):
        self.server = server

    def __enter__(self):
        return self.server.start()

    def __exit__(self, *exc):
        self.server.stop()
