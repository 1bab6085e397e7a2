"""The live widget as a person sees it: JupyterLab in headless chromium runs a notebook
whose ``%%xla_spawn -n 4`` cell has one failing replica, and the rendered widget shows
the header, the combined "all" tab and one tab per replica with the right marks, output,
result and traceback; the cell itself ends with an XlaSpawnError. A cell before it runs
six quick runs, so that the spawn cell's widgets are a retired run's, made over: it shows
only its own run, and the retired runs show their summary.

Needs torch_xla (the cell runs real replicas), chromium at /usr/lib/chromium/chromium
(``scripts/env --browser`` installs it) and the playwright Python package; any of them
missing is a failure that says how to install it, not a skip (tests/test_browser_classic.py
shares this check). A full-page screenshot is left in ``test-artifacts/widget.png`` whatever
the outcome.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import _jupyterlab as lab  # tests/ is on sys.path (rootdir-relative import mode)
from colab_xla.notebook.views.widget import LIVE_RUNS

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
NOTEBOOK = "widget.ipynb"
REPLICAS = 4
FAILING = 2
RUN_TIMEOUT = 180  # s, from Run All to a finished widget

# Runs before the spawn cell, so that its widgets are a retired run's, made over (issue 18):
# of these, the runs that the next runs retired show their summary, the others their widget.
WARM_UP_RUNS = 6
WARM_UP_CELL = f"""for _run in range({WARM_UP_RUNS}):
    get_ipython().run_cell_magic("xla_spawn", "-n {REPLICAS}", 'print("warm-up", index)')"""
WARM_UP_LIVE = LIVE_RUNS - 1  # the spawn cell's run is the last of the live ones
SPAWN_AT = 2  # the spawn cell's index

# Every replica runs a tqdm bar; replica 1 plots (drawn in its tab: issue 34).
PLOTTING = 1
SPAWN_CELL = f"""%%xla_spawn -n {REPLICAS}
import matplotlib.pyplot as plt
from tqdm.auto import tqdm
print("hello from", index)
for _ in tqdm(range(20), desc=f"steps {{index}}"):
    pass
if index == {PLOTTING}:
    plt.figure(figsize=(3, 2))
    plt.plot([0, 1, 2], [0, 1, 4])
    plt.title("replica {PLOTTING}'s plot")
    plt.show()
if index == {FAILING}:
    raise ValueError("replica two fails")
index * 10"""


def check_plots_and_bars(widget, name: str) -> None:
    """Replica 1's tab draws its figure between its lines and each replica's tab its bar,
    finished: the page shown is the one ``show_tab`` opened last. The widget's picture is
    left in ``test-artifacts/widget-plots-NAME.png`` (docs/ shows it)."""
    page = widget.locator(".widget-tab-contents > :not(.lm-mod-hidden):not(.p-mod-hidden)")
    assert page.locator("img[src^='data:image/png']").count() == 1, page.first.inner_html()
    bars = page.locator("progress")
    assert bars.count() == 1 and bars.first.get_attribute("value") == "1.000"
    assert f"steps {PLOTTING}: 100%" in page.first.inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    # (the widget: its header and tabs, for docs/)
    widget.locator("xpath=..").screenshot(path=str(ARTIFACTS / f"widget-plots-{name}.png"))


def write_notebook(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("%load_ext colab_xla"),
                nbformat.v4.new_code_cell(WARM_UP_CELL),
                nbformat.v4.new_code_cell(SPAWN_CELL)]
    nbformat.write(nb, str(path))


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


def check_warm_up(cell) -> None:
    """The warm-up cell: its retired runs show their summary, the others their widget."""
    assert cell.locator(".widget-tab").count() == WARM_UP_LIVE, cell.inner_text()
    summaries = cell.get_by_text(f"{REPLICAS} replicas on CPU: {REPLICAS} done").count()
    assert summaries == WARM_UP_RUNS - WARM_UP_LIVE, cell.inner_text()


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
@pytest.mark.timeout(300)
def test_widget_in_jupyterlab(tmp_path):
    sync_playwright = require_browser_stack()
    from run_notebooks import kernel_env  # tools/ is on sys.path (conftest.py)

    root = tmp_path / "root"
    root.mkdir()
    write_notebook(root / NOTEBOOK)
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

            def finished():
                if page.locator(lab.KERNEL_IDLE).count() == 0:
                    return False
                if widget.count() != 1:
                    return False
                labels = tab_labels(widget)
                done = len(labels) == REPLICAS + 1 and not any("▶" in t for t in labels)
                return labels if done else None

            def state():
                status = page.locator(".jp-Notebook-ExecutionIndicator").get_attribute(
                    "data-status")
                return (f"a finished widget (kernel: {status}; widgets: {widget.count()}; "
                        f"tabs: {tab_labels(widget) if widget.count() == 1 else None}; "
                        f"cell text: {spawn.inner_text()[-2000:]!r}; "
                        f"server log: {server.log_tail(2000)})")

            labels = lab.wait_until(finished, RUN_TIMEOUT, what=state)
            assert labels == ["all", "0 ✓", "1 ✓", "2 ✗", "3 ✓"]

            header = spawn.locator(".widget-vbox .widget-html-content").first.inner_text()
            assert f"{REPLICAS} replicas" in header, header
            assert f"failed: replica {FAILING}" in header, header
            failed_span = spawn.locator(".widget-html-content span", has_text="failed: replica")
            assert failed_span.evaluate("e => getComputedStyle(e).color") == "rgb(207, 34, 46)"

            combined = show_tab(widget, "all")
            for i in range(REPLICAS):
                assert f"[replica {i}] hello from {i}" in combined, combined
            assert "warm-up" not in combined, combined  # (its widgets are a retired run's)

            ok = show_tab(widget, "1 ✓")
            assert "hello from 1" in ok and "warm-up" not in ok, ok
            assert "Out: 10" in ok, ok
            assert "hello from 2" not in ok, ok
            check_plots_and_bars(widget, "jupyterlab-ipywidgets8")

            failed = show_tab(widget, "2 ✗")
            assert "hello from 2" in failed, failed
            assert "ValueError: replica two fails" in failed, failed
            assert "Cell In[" in failed, failed
            assert "hello from 1" not in failed, failed
            assert re.search(rf"replica {FAILING} · failed", failed), failed

            errors = spawn.locator(".jp-OutputArea-output[data-mime-type="
                                   "'application/vnd.jupyter.stderr']").all_inner_texts()
            assert any("XlaSpawnError" in e for e in errors), (errors, spawn.inner_text())
            check_warm_up(cells.nth(1))
            # the first cell ran quietly
            assert cells.nth(0).locator(".jp-OutputArea-output").count() == 0, \
                cells.nth(0).inner_text()
        finally:
            try:
                page.screenshot(path=str(screenshot), full_page=True)
            finally:
                browser.close()
