"""What a person sees and keeps, in JupyterLab 4 in headless chromium.

A notebook runs a one-off run, a session's cell, an auto-mode cell and a ``%%xla_spawn -n 4``
cell whose replicas print, run a tqdm bar (replica 1 plots too) and wait for a file the test
makes once it has seen the live widget: a header, the "all" tab and a tab per replica with
its output, figure and bar. Then replica 2 fails, and every run's display is its static form
(a section per replica, failed first and open; the cell ends with an XlaSpawnError). The
notebook is saved and its kernel shut down; it is opened again (a new kernel, none of the old
one's widget models), then a copy of it that is not trusted, and converted by ``jupyter
nbconvert --to html``: each shows every replica's output, result, error, picture and bar, and
never "Error displaying widget" (issue 55: the last runs' displays named their widget, and
without its model JupyterLab drew that error instead of the results).

Needs torch_xla (the cell runs real replicas), chromium at /usr/lib/chromium/chromium
(``scripts/env --browser`` installs it) and the playwright Python package; any of them
missing is a failure that says how to install it, not a skip (tests/test_browser_classic.py
shares this check). Screenshots are left in ``test-artifacts/`` (``widget.png``, the page
at the end, whatever the outcome; the live widget, the reopened, untrusted and converted
notebooks: docs/ shows some of them).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

import _jupyterlab as lab  # tests/ is on sys.path (rootdir-relative import mode)

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
NOTEBOOK = "widget.ipynb"
REPLICAS = 4
FAILING = 2
RUN_TIMEOUT = 180  # s, from Run All to a finished widget

# Runs before the spawn cell, so that its widgets are an ended run's, made over (issue 18);
# each ends as its static form.
WARM_UP_RUNS = 2
WARM_UP_CELL = f"""for _run in range({WARM_UP_RUNS}):
    get_ipython().run_cell_magic("xla_spawn", "-n {REPLICAS}", 'print("warm-up", index)')"""
# An output whose <style> a sanitizer removes: whether the notebook is trusted, as drawn.
PROBE_CELL = ("from IPython.display import HTML\n"
              "HTML(\"<div class='trust-probe'><style>.trust-probe {}</style>probe</div>\")")
SESSION_CELLS = ["%xla_session start -n 2",
                 "%%xla_spawn\nprint('session cell on', index)\nindex + 100",
                 "%xla_session auto on",
                 "print('auto cell on', index)\nindex + 200",
                 "%xla_session auto off",
                 "%xla_session stop"]
SESSION_AT, AUTO_AT = 4, 6  # the session's cell and the auto cell
SPAWN_AT = 9  # the spawn cell's index: the last (its error stops Run All)

# Every replica runs a tqdm bar; replica 1 plots (drawn in its tab: issue 34). With a gate,
# the replicas wait for that file before they end (the test makes it once it saw them live).
PLOTTING = 1
SPAWN_CELL = """%%xla_spawn -n {replicas}
import os, time
import matplotlib.pyplot as plt
from tqdm.auto import tqdm
print("hello from", index)
for _ in tqdm(range(20), desc=f"steps {{index}}"):
    pass
if index == {plotting}:
    plt.figure(figsize=(3, 2))
    plt.plot([0, 1, 2], [0, 1, 4])
    plt.title("replica {plotting}'s plot")
    plt.show()
while {gate!r} and not os.path.exists({gate!r}):
    time.sleep(0.02)
if index == {failing}:
    raise ValueError("replica two fails")
index * 10"""


def check_plots_and_bars(widget, name: str) -> None:
    """Replica 1's tab draws its figure between its lines and each replica's tab its bar,
    finished: the page shown is the one ``show_tab`` opened last. The widget's picture is
    left in ``test-artifacts/widget-plots-NAME.png`` (docs/ shows it)."""
    page = widget.locator(".widget-tab-contents > :not(.lm-mod-hidden):not(.p-mod-hidden)")
    lab.wait_until(lambda: page.locator("img[src^='data:image/png']").count() == 1
                   and f"steps {PLOTTING}: 100%" in page.first.inner_text(), 30,
                   what=lambda: f"replica {PLOTTING}'s figure and bar: {page.first.inner_html()}")
    bars = page.locator("progress")
    assert bars.count() == 1 and bars.first.get_attribute("value") == "1.000"
    ARTIFACTS.mkdir(exist_ok=True)
    # (the widget: its header and tabs, for docs/)
    widget.locator("xpath=..").screenshot(path=str(ARTIFACTS / f"widget-plots-{name}.png"))


def write_notebook(path: Path, gate: Optional[Path] = None, sessions: bool = True) -> None:
    """The test's notebook: %load_ext, the trust probe, the warm-up runs, a session's cell
    and an auto cell (``sessions``), then the spawn cell (its replicas wait for ``gate``)."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    cells = ["%load_ext colab_xla", PROBE_CELL, WARM_UP_CELL]
    cells += SESSION_CELLS if sessions else ["pass"] * len(SESSION_CELLS)
    cells.append(SPAWN_CELL.format(replicas=REPLICAS, plotting=PLOTTING, failing=FAILING,
                                   gate=str(gate or "")))
    assert len(cells) == SPAWN_AT + 1
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, str(path))


def saved_spawn_output(path: Path) -> Optional[dict]:
    """The spawn cell's static form as saved in the notebook's file (its display data), or
    None while the file does not have it."""
    import nbformat

    try:
        nb = nbformat.read(str(path), as_version=4)
    except (OSError, ValueError):
        return None
    shown = [o for o in nb.cells[SPAWN_AT].get("outputs", [])
             if o.get("output_type") == "display_data"]
    return shown[0]["data"] if shown and "colab-xla-summary" in shown[0]["data"].get(
        "text/html", "") else None


def untrusted_copy(path: Path, name: str) -> Path:
    """A copy of a saved notebook as if edited elsewhere: unsigned, so not trusted."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    nb.metadata["edited_elsewhere"] = True
    copy = path.with_name(name)
    nbformat.write(nb, str(copy))
    return copy


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def check_saved_file(path: Path) -> None:
    """No output of the saved notebook names a widget: none is drawn without its model."""
    nb = json.loads(path.read_text())
    named = [i for i, c in enumerate(nb["cells"]) for o in c.get("outputs", [])
             if WIDGET_VIEW in o.get("data", {})]
    assert not named, f"cells {named} still name a widget view"


def check_static(page, cells, picture: Optional[str] = None, styled: bool = True,
                 sessions: bool = True) -> None:
    """Every run's end as its static form in ``cells`` (a locator of the code cells): the
    spawn cell's section per replica, failed first and open, each with its output, bar,
    result or error, replica 1's picture drawn; the warm-up, session and auto cells' too.
    No widget is shown and none failed to show. ``picture``: a screenshot of the spawn
    cell, replica 1's section opened, into test-artifacts/. ``styled``: inline styles kept
    (a trusted notebook; the Notebook's sanitizer removes them). ``sessions``: the notebook
    has the session's cells (:func:`write_notebook`)."""
    assert page.get_by_text("Error displaying widget").count() == 0, page.inner_text("body")
    assert page.locator(".widget-tab").count() == 0
    spawn = cells.nth(SPAWN_AT).locator(".colab-xla-summary")
    assert spawn.count() == 1, cells.nth(SPAWN_AT).inner_text()
    head = spawn.locator("p").first.inner_text()
    assert f"{REPLICAS} replicas on CPU: 3 done, 1 failed" in head and "failed: replica 2" in head
    sections = spawn.locator("details.colab-xla-replica")
    assert sections.count() == REPLICAS
    order = [FAILING] + [o for o in range(REPLICAS) if o != FAILING]
    for at, o in enumerate(order):
        section = sections.nth(at)
        summary = section.locator("summary").inner_text()
        assert summary.startswith(f"replica {o} · "), summary
        assert (section.get_attribute("open") is not None) == (o == FAILING), summary
        text = section.text_content()
        assert f"hello from {o}" in text and f"steps {o} 20/20" in text, text
        assert section.locator("progress").get_attribute("value") == "1.000"
        if o == FAILING:
            assert "✗ failed" in summary and "ValueError: replica two fails" in summary
            shown = section.inner_text()  # (open: drawn, not only in the page)
            assert "hello from 2" in shown and "Cell In[" in shown, shown
            assert "ValueError: replica two fails" in shown.split("Cell In[", 1)[1], shown
        else:
            assert "✓ done" in summary and f"Out: {o * 10}" in summary, summary
            assert f"Out: {o * 10}" in text
    plot = sections.nth(order.index(PLOTTING))
    assert plot.locator("img[src^='data:image/png']").count() == 1
    assert sum(s.locator("img").count() for s in sections.all()) == 1
    plot.locator("summary").click()  # opened without a script
    image = plot.locator("img")
    image.wait_for(state="visible", timeout=10_000)
    assert image.evaluate("e => e.naturalWidth") > 100  # (decoded: a picture, not a stub)
    assert "hello from 1" in plot.inner_text()
    if styled:
        assert sections.first.locator("summary span").first.evaluate(
            "e => getComputedStyle(e).color") == "rgb(207, 34, 46)"
    if picture:
        ARTIFACTS.mkdir(exist_ok=True)
        cells.nth(SPAWN_AT).screenshot(path=str(ARTIFACTS / picture))
    warm = cells.nth(2).locator(".colab-xla-summary")
    assert warm.count() == WARM_UP_RUNS
    assert all(f"{REPLICAS} replicas on CPU: {REPLICAS} done" in t for t in warm.all_inner_texts())
    for at, words, value in ((SESSION_AT, "session cell on", 100),
                             (AUTO_AT, "auto cell on", 200))[:2 if sessions else 0]:
        summary = cells.nth(at).locator(".colab-xla-summary")
        assert summary.count() == 1, cells.nth(at).inner_text()
        text = summary.text_content()
        assert "2 replicas on CPU: 2 done" in text, text
        for o in range(2):
            assert f"{words} {o}" in text and f"Out: {value + o}" in text, text


def trust_probe_styles(cells) -> int:
    """How many <style> elements the trust probe's output kept: 1 trusted, 0 sanitized."""
    probe = cells.nth(1).locator(".trust-probe")
    probe.wait_for(timeout=30_000)
    return probe.locator("style").count()


def delete_sessions(server) -> int:
    """Shut every kernel of the server down (its sessions deleted, as closing a notebook
    and shutting its kernel down does); how many there were."""
    def call(method, path):
        request = urllib.request.Request(f"{server.url}{path}", method=method,
                                         headers={"Authorization": f"token {server.token}"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.read()

    sessions = json.loads(call("GET", "/api/sessions"))
    for session in sessions:
        call("DELETE", f"/api/sessions/{session['id']}")
    assert json.loads(call("GET", "/api/kernels")) == []
    return len(sessions)


def nbconvert_html(notebook: Path, out_dir: Path) -> Path:
    """``jupyter nbconvert --to html`` of ``notebook``: the HTML file's path."""
    subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", "--output-dir",
                    str(out_dir), str(notebook)], check=True, capture_output=True, timeout=120)
    return out_dir / f"{notebook.stem}.html"


def require_browser_stack():
    # found, not imported: no PJRT_DEVICE side effect
    if importlib.util.find_spec("torch_xla") is None:
        pytest.fail("torch_xla is not installed: the browser tests run real replicas (install "
                    "the pinned torch/torch_xla pair with `pip install -r requirements-dev.txt`, "
                    "or `scripts/env`)", pytrace=False)
    if not lab.CHROMIUM.exists():
        pytest.fail(f"chromium is not installed at {lab.CHROMIUM}: the browser tests need it "
                    "(install it with `scripts/env --browser`, or apt-get install chromium)",
                    pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.fail(f"the playwright Python package is missing ({e}): pip install playwright "
                    "(no `playwright install`: the test uses the system chromium)", pytrace=False)
    return sync_playwright


def tab_labels(widget) -> list:
    """The widget's tab titles: ipywidgets 8 draws tabs with lumino (``lm-``), 7 with
    phosphor (``p-``; tests/test_browser_classic.py)."""
    return [t.strip() for t in
            widget.locator(".lm-TabBar-tabLabel, .p-TabBar-tabLabel").all_inner_texts()]


def show_tab(widget, label: str) -> str:
    """Click the tab titled ``label``; return the text of the tab's (now visible) page."""
    widget.locator(".lm-TabBar-tab, .p-TabBar-tab", has_text=label).first.click()
    page = widget.locator(".widget-tab-contents > :not(.lm-mod-hidden):not(.p-mod-hidden)").first
    page.wait_for(state="visible", timeout=10_000)
    return page.inner_text()



@pytest.mark.browser
@pytest.mark.timeout(420)
def test_live_widget_then_static_form_kept_when_reopened_untrusted_and_converted(tmp_path):
    sync_playwright = require_browser_stack()
    from run_notebooks import kernel_env  # tools/ is on sys.path (conftest.py)

    root = tmp_path / "root"
    root.mkdir()
    gate = tmp_path / "gate"
    notebook = root / NOTEBOOK
    write_notebook(notebook, gate=gate)
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "widget.png"
    screenshot.unlink(missing_ok=True)

    with lab.jupyterlab(root, tmp_path / "state", kernel_env()) as server, \
            sync_playwright() as pw:
        browser = lab.launch_chromium(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.set_default_timeout(30_000)
        try:
            lab.open_notebook(page, server, NOTEBOOK)
            tries = lab.run_all_cells(page)
            print(f"Run All Cells took {tries} tries")  # shown with the failure report

            cells = page.locator(".jp-Notebook .jp-CodeCell")
            spawn = cells.nth(SPAWN_AT)
            widget = spawn.locator(".widget-tab")

            def live():
                """The tab titles, once every replica has its tab and waits at the gate
                (its bar and figure done: a tab's output comes within a few seconds)."""
                if widget.count() != 1:
                    return None
                labels = tab_labels(widget)
                return labels if len(labels) == REPLICAS + 1 else None

            def state():
                return (f"the live widget (widgets: {widget.count()}; tabs: "
                        f"{tab_labels(widget) if widget.count() == 1 else None}; cell text: "
                        f"{spawn.inner_text()[-2000:]!r}; server log: {server.log_tail(2000)})")

            # The run, live: the replicas wait at the gate until the test has seen them.
            labels = lab.wait_until(live, RUN_TIMEOUT, what=state)
            assert labels == ["all"] + [f"{o} ▶" for o in range(REPLICAS)], labels
            header = spawn.locator(".widget-vbox .widget-html-content").first.inner_text()
            assert f"{REPLICAS} replicas" in header and "running" in header, header
            widget.locator(".lm-TabBar-tab, .p-TabBar-tab", has_text="all").first.click()
            shown = widget.locator(".widget-tab-contents > :not(.lm-mod-hidden)"
                                   ":not(.p-mod-hidden)").first
            combined = lab.wait_until(
                lambda: (lambda t: t if all(f"[replica {i}] hello from {i}" in t
                                            for i in range(REPLICAS)) else None)(
                    shown.text_content()), RUN_TIMEOUT, what=state)
            assert "warm-up" not in combined, combined  # (its widgets are an ended run's)
            # (a tab's output comes at the draw after it is shown: its state line first)
            mine = lab.wait_until(lambda: (lambda t: t if f"hello from {PLOTTING}" in t else None)(
                show_tab(widget, f"{PLOTTING} ▶")), 30, what="replica 1's line in its tab")
            assert "warm-up" not in mine, mine
            check_plots_and_bars(widget, "jupyterlab-ipywidgets8")
            gate.touch()

            # The end: every run's display is its static form; the cell's error after it.
            lab.wait_until(lambda: page.locator(lab.KERNEL_IDLE).count() == 1
                           and spawn.locator(".colab-xla-summary").count() == 1, RUN_TIMEOUT,
                           what=lambda: f"the run's end ({spawn.inner_text()[-2000:]!r})")
            errors = spawn.locator(".jp-OutputArea-output[data-mime-type="
                                   "'application/vnd.jupyter.stderr']").all_inner_texts()
            assert any("XlaSpawnError" in e for e in errors), (errors, spawn.inner_text())
            assert cells.nth(0).locator(".jp-OutputArea-output").count() == 0  # (quiet)
            assert trust_probe_styles(cells) == 1
            check_static(page, cells, picture="ended-jupyterlab.png")

            # Saved, and its kernel shut down.
            cells.nth(0).locator(".jp-InputPrompt").click()
            page.keyboard.press("Control+s")
            lab.wait_until(lambda: saved_spawn_output(notebook), 60, what="the saved notebook")
            check_saved_file(notebook)
            assert delete_sessions(server) == 1

            # Opened again, with a kernel of its own (none of the old one's widget models),
            # then a copy of it that is not trusted: its HTML is sanitized.
            untrusted = untrusted_copy(notebook, "untrusted.ipynb")
            for name, trusted in ((NOTEBOOK, True), (untrusted.name, False)):
                lab.open_notebook(page, server, name)
                cells = page.locator(".jp-Notebook .jp-CodeCell")
                cells.nth(SPAWN_AT).locator(".colab-xla-summary").wait_for()
                assert trust_probe_styles(cells) == (1 if trusted else 0)
                check_static(page, cells, picture=f"reopened-{'' if trusted else 'un'}"
                             "trusted-jupyterlab.png")
            delete_sessions(server)

            # Converted, as nbviewer shows it (GitHub's renderer is its own, of text/html).
            converted = nbconvert_html(notebook, tmp_path)
            page.goto(converted.as_uri(), wait_until="load")
            cells = page.locator(".jp-Cell.jp-CodeCell")
            assert cells.count() == SPAWN_AT + 1
            check_static(page, cells, picture="nbconvert.png")
        finally:
            try:
                page.screenshot(path=str(screenshot), full_page=True)
            finally:
                browser.close()
