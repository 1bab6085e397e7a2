"""What a person sees and keeps under ipywidgets 7, as Colab's stack has it: the classic
Notebook (6.5) in headless chromium, kernels with IPython 7.34, ipykernel 6.17.1 and
ipywidgets 7.7.1 (the ``colab`` stack: ``scripts/test`` runs these with ``-m
browser_classic``). Colab's own frontend cannot run here; the classic Notebook with the
widgets nbextension is the ipywidgets 7 frontend that can.

- With widgetsnbextension 3.6.1, the release made with ipywidgets 7.7.1, from the directory
  ``scripts/env --stack colab`` fills (``$COLAB_XLA_CLASSIC_FRONTEND``): tests/test_browser.py's
  notebook, its spawn cell seen live (the header, the "all" tab, a tab per replica with its
  output, figure and bar), then every run's static form; saved, its kernel shut down, opened
  again, then a copy that is not trusted (its HTML sanitized, inline styles removed): every
  replica's output, result, error and picture is there, and no widget.
- With the stack's own widgetsnbextension 3.6.10 (the one Colab's image pins, and never
  serves: Colab draws widgets itself), which cannot create ipywidgets 7.7.1's Output model
  ("_deserialize_state is not a function"), so the live widget is never drawn: the cell still
  ends with every replica's results shown (issue 55: it showed only its "no TPU" line).

Screenshots and each page's console and kernel messages with the output areas' DOM are left in
``test-artifacts/`` (``widget-classic*.png``, ``widget-classic*-log.txt``).

A missing piece (torch_xla, chromium, playwright, ipywidgets 7, the frontend directory) is a
failure that says how to get it, not a skip, as in tests/test_browser.py.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Optional

import pytest

import _jupyterlab as lab  # tests/ is on sys.path (rootdir-relative import mode)
from test_browser import (PLOTTING, REPLICAS, SPAWN_AT, check_plots_and_bars,
                          check_saved_file, check_static, delete_sessions, require_browser_stack,
                          saved_spawn_output, show_tab, tab_labels, trust_probe_styles,
                          untrusted_copy, write_notebook)

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




def _require_ipywidgets_7():
    import ipywidgets

    assert ipywidgets.__version__.startswith("7."), (
        f"this test is for ipywidgets 7 (Colab's); this stack has {ipywidgets.__version__}")


class _Page:
    """A chromium page on the classic Notebook, recording its console and kernel messages
    (evidence for a failure, left in ``test-artifacts/NAME-log.txt`` with the output areas'
    DOM, and a full-page screenshot ``NAME.png``)."""

    def __init__(self, browser, server, name: str):
        self.server, self.name = server, name
        self.page = browser.new_page(viewport={"width": 1280, "height": 1000})
        self.page.set_default_timeout(30_000)
        self.console_errors, self.evidence, self.sent = [], [], []
        self.page.on("console", lambda m: (
            self.evidence.append(f"console.{m.type}: {m.text[:500]}"),
            m.type == "error" and self.console_errors.append(m.text)))

        def watch(ws):
            ws.on("framereceived", lambda f: self.evidence.append("<- " + _describe_frame(f)))
            ws.on("framesent", lambda f: (self.evidence.append("-> " + _describe_frame(f)),
                                          self.sent.append(_msg_type(f))))

        self.page.on("websocket", watch)

    def open(self, notebook: str):
        """Open ``notebook``, and wait until its kernel is connected and the widget manager
        has asked for the kernel's widgets. The manager restores them once the kernel is
        connected (jupyter.widget.control, which ipywidgets 7.7 lacks, then
        comm_info_request), and then re-renders every cell that shows a widget: it clears
        the cell's output and redraws it from its JSON without display ids, so a cell that
        ran before that restore ended would drop the run's closing update_display_data ("No
        targets for display_id"). A person opening a notebook waits that long; this waits
        until the manager has asked for the kernel's comms, then for an answer to a
        comm_info request of its own: the shell channel answers in order."""
        self.sent.clear()
        self.page.goto(f"{self.server.url}/notebooks/{notebook}?token={self.server.token}",
                       wait_until="domcontentloaded")
        self.page.wait_for_function(_CONNECTED_JS, timeout=120_000, polling=200)
        # (page.evaluate: the sync API delivers the websocket's events during its calls)
        lab.wait_until(lambda: self.page.evaluate("() => true")
                       and "comm_info_request" in self.sent,
                       MANAGER_TIMEOUT, what="the widget manager's comm_info_request")
        self.page.evaluate(_COMM_INFO_JS)
        return self.page.locator("#notebook .cell.code_cell")

    def wait_ended(self, cells):
        """Wait for the spawn cell's end: its static form, then its error."""
        spawn = cells.nth(SPAWN_AT)
        lab.wait_until(lambda: spawn.locator(".output_error").count() == 1
                       and spawn.locator(".colab-xla-summary").count() == 1, RUN_TIMEOUT,
                       what=lambda: (f"the run's end (cell text: {spawn.inner_text()[-2000:]!r};"
                                     f" console errors: {self.console_errors[:5]}; server log: "
                                     f"{self.server.log_tail(2000)}; kernel messages: "
                                     f"test-artifacts/{self.name}-log.txt)"))
        error = spawn.locator(".output_error").all_inner_texts()
        assert any("XlaSpawnError" in e for e in error), spawn.inner_text()

    def close(self):
        try:
            dom = self.page.evaluate("() => Array.from(document.querySelectorAll("
                                     "'#notebook .cell.code_cell .output')).map(e => e.outerHTML)"
                                     ".join('\\n\\n')")
            (ARTIFACTS / f"{self.name}-log.txt").write_text(
                "\n".join(self.evidence) + "\n\nthe cells' output areas:\n" + dom)
            self.page.screenshot(path=str(ARTIFACTS / f"{self.name}.png"), full_page=True)
        finally:
            self.page.close()


@pytest.mark.browser_classic
@pytest.mark.timeout(480)
def test_live_widget_then_static_form_kept_in_the_classic_notebook_under_ipywidgets_7(tmp_path):
    sync_playwright = require_browser_stack()
    from run_notebooks import kernel_env  # tools/ is on sys.path (conftest.py)

    _require_ipywidgets_7()
    frontend = os.environ.get(FRONTEND_VAR)
    assert frontend and Path(frontend, "share", "jupyter", "nbextensions").is_dir(), (
        f"${FRONTEND_VAR} must name the widget frontend that `scripts/env --stack colab` "
        f"installs (got {frontend!r})")
    root = tmp_path / "root"
    root.mkdir()
    gate = tmp_path / "gate"
    notebook = root / "widget.ipynb"
    write_notebook(notebook, gate=gate)
    ARTIFACTS.mkdir(exist_ok=True)

    server = lab.ClassicNotebookServer(root, tmp_path / "state", kernel_env(),
                                       frontend_dir=Path(frontend))
    with _started(server), sync_playwright() as pw:
        browser = lab.launch_chromium(pw)
        shown = _Page(browser, server, "widget-classic")
        page = shown.page
        try:
            cells = shown.open(notebook.name)
            page.evaluate("() => Jupyter.notebook.execute_all_cells()")
            spawn = cells.nth(SPAWN_AT)
            widget = spawn.locator(".widget-tab")

            def live():
                """The tab titles once the widget has titled every replica's tab (ipywidgets
                7 titles a new tab a moment after drawing it); else None."""
                if widget.count() != 1:
                    return None
                labels = tab_labels(widget)
                return labels if len(labels) == REPLICAS + 1 and all(labels) else None

            labels = lab.wait_until(live, RUN_TIMEOUT, what=lambda: (
                f"the live widget (widgets: {widget.count()}; cell text: "
                f"{spawn.inner_text()[-2000:]!r}; console errors: {shown.console_errors[:5]})"))
            assert labels == ["all"] + [f"{o} ▶" for o in range(REPLICAS)], labels
            header = spawn.locator(".widget-html-content").first.inner_text()
            assert f"{REPLICAS} replicas" in header and "running" in header, header
            mine = lab.wait_until(lambda: (lambda t: t if f"hello from {PLOTTING}" in t else None)(
                show_tab(widget, f"{PLOTTING} ▶")), 30, what="replica 1's line in its tab")
            assert "warm-up" not in mine, mine  # (its widgets are an ended run's)
            check_plots_and_bars(widget, "classic-ipywidgets7")
            gate.touch()

            shown.wait_ended(cells)
            assert trust_probe_styles(cells) == 1
            check_static(page, cells, picture="ended-classic.png")
            assert not [e for e in shown.console_errors if "model" in e.lower()], (
                shown.console_errors)

            page.evaluate("() => Jupyter.notebook.save_notebook()")
            lab.wait_until(lambda: saved_spawn_output(notebook), 60, what="the saved notebook")
            check_saved_file(notebook)
            assert delete_sessions(server) == 1
        finally:
            shown.close()

        # Opened again (a new kernel: none of the old one's widget models), then a copy of it
        # that is not trusted: the Notebook sanitizes its HTML, inline styles too.
        untrusted = untrusted_copy(notebook, "untrusted.ipynb")
        for name, trusted in ((notebook.name, True), (untrusted.name, False)):
            again = _Page(browser, server,
                          f"widget-classic-reopened{'' if trusted else '-untrusted'}")
            try:
                cells = again.open(name)
                assert again.page.evaluate("() => Jupyter.notebook.trusted") is trusted
                assert trust_probe_styles(cells) == (1 if trusted else 0)
                check_static(again.page, cells, styled=trusted,
                             picture=f"reopened-{'' if trusted else 'un'}trusted-classic.png")
            finally:
                again.close()
        browser.close()


@pytest.mark.browser_classic
@pytest.mark.timeout(300)
def test_a_frontend_that_cannot_draw_the_widget_still_ends_with_every_result_shown(tmp_path):
    """widgetsnbextension 3.6.10 against ipywidgets 7.7.1: the live widget is never drawn."""
    sync_playwright = require_browser_stack()
    from run_notebooks import kernel_env  # tools/ is on sys.path (conftest.py)

    _require_ipywidgets_7()
    import widgetsnbextension

    assert widgetsnbextension.__version__ == "3.6.10", widgetsnbextension.__version__
    root = tmp_path / "root"
    root.mkdir()
    write_notebook(root / "widget.ipynb", sessions=False)
    ARTIFACTS.mkdir(exist_ok=True)
    # No frontend_dir: the Notebook serves the env's own nbextension, 3.6.10.
    server = lab.ClassicNotebookServer(root, tmp_path / "state", kernel_env())
    with _started(server), sync_playwright() as pw:
        browser = lab.launch_chromium(pw)
        shown = _Page(browser, server, "widget-classic-3.6.10")
        try:
            cells = shown.open("widget.ipynb")
            shown.page.evaluate("() => Jupyter.notebook.execute_all_cells()")
            shown.wait_ended(cells)
            check_static(shown.page, cells, sessions=False,
                         picture="classic-widgetsnbextension-3.6.10.png")
            # (the frontend could not draw it: what the issue saw)
            assert any("_deserialize_state" in e for e in shown.console_errors), (
                shown.console_errors)
        finally:
            shown.close()
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
