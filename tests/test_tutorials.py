"""Tutorials 02 (devices and output) and 04 (when things go wrong), run in a real kernel.

Each notebook runs once (module fixtures) through ``run_notebooks.execute_notebook``; the
tests read its executed copy: what each replica showed, the errors of the cells that fail on
purpose (tagged ``raises-exception``) and of no other cell, the guard's message from a
separate process, the timeout and fail-fast reports, and ``%xla_doctor``.
"""

from __future__ import annotations

import html
import re
import shutil
import tempfile

import pytest

import nbformat  # the test command installs every layer's tools: a missing one fails

import run_notebooks  # noqa: E402  (tools/ is on sys.path: conftest.py)
# tests/ is on sys.path (rootdir-relative import mode): the notebook readers of test_notebooks
from test_notebooks import assert_every_cell_ran, cell, errors_of, replica_blocks, text_of  # noqa: E402

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(600)]

DEVICES = run_notebooks.NOTEBOOKS_DIR / "02-devices-and-output.ipynb"
WRONG = run_notebooks.NOTEBOOKS_DIR / "04-when-things-go-wrong.ipynb"
REPLICAS = 4
TIMEOUT = 240  # per cell
RAISES = "raises-exception"


# --- reading an executed notebook ---------------------------------------------------------


def tagged(c) -> bool:
    return RAISES in c.get("metadata", {}).get("tags", [])


def summary(text: str, headline: str, states=None):
    """The run's blocks ``{ordinal: (state, lines)}``, after checking its headline.

    ``headline`` is the regex of what follows "4 replicas on CPU: " up to " in T s"; returns
    also T. ``states`` (default: all done) is each replica's expected state.
    """
    m = re.search(rf"^{REPLICAS} replicas on CPU: {headline} in (\d+\.\d\d) s"
                  r"(?: · results in `\w+`)?$", text, re.M)
    assert m, text
    blocks = replica_blocks(text)
    assert sorted(blocks) == list(range(REPLICAS)), text
    found = {}
    for i, (heading, lines) in blocks.items():
        state = re.match(rf"── replica {i} · (\w+)", heading).group(1)
        found[i] = (state, lines)
    states = states or {i: "done" for i in range(REPLICAS)}
    assert {i: s for i, (s, _) in found.items()} == states, text
    return found, float(m.group(1))


def process_lines(text: str, label: str = "process 0"):
    """Lines under ``── process 0 (output not tied to one replica)``."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("── "):
            inside = line.startswith(f"── {label} ")
        elif inside:
            lines.append(line)
    return lines


def the_error(c):
    errors = errors_of(c)
    assert len(errors) == 1, (c.id, errors)
    return errors[0], "\n".join(errors[0]["traceback"])


def visible_html(html_path) -> str:
    """What a reader of the HTML sees without JavaScript, unescaped."""
    text = html_path.read_text(encoding="utf-8")
    text = re.sub(r"<script\b.*?</script>", "", text, flags=re.S | re.I)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


@pytest.fixture(scope="module")
def devices(tmp_path_factory):
    return run_notebooks.execute_notebook(DEVICES, tmp_path_factory.mktemp("devices"), TIMEOUT)


@pytest.fixture(scope="module")
def wrong(tmp_path_factory):
    # Its kernel's temporary files (colab_xla's pid registry among them) are its own: the
    # doctor cell says "leftover processes 0", and a test on the other worker whose kernel
    # is killed leaves processes in the shared registry for a moment.
    own = tempfile.mkdtemp(prefix="wrong-")  # (short: Unix socket paths are limited)
    try:
        return run_notebooks.execute_notebook(
            WRONG, tmp_path_factory.mktemp("wrong"), TIMEOUT,
            env={**run_notebooks.kernel_env(), "TMPDIR": own})
    finally:
        shutil.rmtree(own, ignore_errors=True)


# --- both notebooks ------------------------------------------------------------------------


@pytest.mark.stacks("colab")
@pytest.mark.parametrize("path", [DEVICES, WRONG] + [
    run_notebooks.NOTEBOOKS_DIR / name
    for name in ("03-mnist-every-replica.ipynb", "06-warm-session.ipynb", "07-pod-slice.ipynb",
                 "08-torchax.ipynb")],
    ids=lambda p: p.stem)
def test_saved_clean_with_stable_ids(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    ids = [c.get("id") for c in nb.cells]
    assert all(ids) and len(set(ids)) == len(ids), ids
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, c.id


@pytest.mark.parametrize("name, expected_raising", [
    ("devices", set()),
    pytest.param("wrong", {"raise", "rendezvous", "timeout", "partial"},
                 marks=pytest.mark.stacks("colab")),
])
def test_only_tagged_cells_raise_and_they_do(name, expected_raising, request):
    nb, _, ipynb_path = request.getfixturevalue(name)
    assert ipynb_path.exists()
    assert {c.id for c in nb.cells if tagged(c)} == expected_raising
    assert_every_cell_ran(nb, may_raise=expected_raising)


# --- 02: devices and output ------------------------------------------------------------------


def test_device_is_created_on_first_use(devices):
    nb = devices[0]
    blocks, _ = summary(text_of(cell(nb, "device")), f"{REPLICAS} done")
    for i, (_, lines) in blocks.items():
        assert lines == [f"replica {i}: 'device' in globals() before first use: False, after: True",
                         "Out: 'xla:0'"], (i, lines)  # a process each: its device 0
    shown = text_of(cell(nb, "device-nb"))
    assert "{0: 'xla:0', 1: 'xla:0', 2: 'xla:0', 3: 'xla:0'}" in shown
    assert "'device' in the notebook: False" in shown


def test_output_is_kept_per_replica(devices):
    nb, html_path, _ = devices
    blocks, _ = summary(text_of(cell(nb, "output")), f"{REPLICAS} done")
    for i, (_, lines) in blocks.items():
        assert lines == [f"replica {i}: step {s} of 3" for s in range(3)] + [
            f"replica {i}: a warning on stderr", f"replica {i}: done"], (i, lines)
    visible = visible_html(html_path)  # the saved HTML summary shows it too
    for i in range(REPLICAS):
        assert f"replica {i}: step 2 of 3" in visible, i


def test_lock_keeps_each_replicas_lines_together_in_a_shared_file(devices):
    nb = devices[0]
    blocks, _ = summary(text_of(cell(nb, "lock")), f"{REPLICAS} done")
    for i, (_, lines) in blocks.items():
        assert lines == [f"replica {i} wrote its 3 lines"], (i, lines)
    shown = text_of(cell(nb, "lock-read")).splitlines()
    written, verdict = shown[:-1], shown[-1]
    assert verdict == "12 lines, each replica's lines together: True", shown
    assert len(written) == 3 * REPLICAS, written
    order = []
    for k in range(0, len(written), 3):
        m = re.fullmatch(r"replica (\d): begin", written[k])
        assert m, written
        i = m.group(1)
        assert written[k:k + 3] == [f"replica {i}: {p}"
                                    for p in ("begin", "middle", "end")], written
        order.append(int(i))
    assert sorted(order) == list(range(REPLICAS)), written


def test_results_arrive_as_cpu_tensors(devices):
    nb = devices[0]
    blocks, _ = summary(text_of(cell(nb, "results")), f"{REPLICAS} done")
    for i, (_, lines) in blocks.items():
        t = [f"{10.0 * i + k:.0f}." for k in range(3)]
        assert lines == [f"Out: tensor([{', '.join(t)}], device='xla:0')"], (i, lines)
    assert text_of(cell(nb, "results-nb")).splitlines() == [
        f"{i} cpu {[10.0 * i + k for k in range(3)]}" for i in range(REPLICAS)]


def test_c_level_output_is_captured(devices):
    nb = devices[0]
    text = text_of(cell(nb, "c-output"))
    blocks, _ = summary(text, f"{REPLICAS} done")
    for i, (_, lines) in blocks.items():
        # a process per replica: C-level output lands with its replica, in its order
        assert sorted(lines) == sorted([f"print from Python in replica {i}",
                                        f"printf from C in replica {i}"]), (i, lines)
    assert process_lines(text) == [], text


def test_guard_refuses_when_the_runtime_is_initialized_first(devices):
    nb = devices[0]
    shown = text_of(cell(nb, "guard"))
    assert shown.startswith("RuntimeInitializedError: The XLA runtime is already initialized in "
                            "this notebook's own process, so replicas cannot be started"), shown
    assert "torch_xla.device()" in shown, shown
    assert "Fix: restart the runtime" in shown, shown
    # ...and the tutorial's own kernel stayed clean
    assert text_of(cell(nb, "runtime-check")).strip().endswith(": False")


# --- 04: when things go wrong ----------------------------------------------------------------


@pytest.mark.stacks("colab")
def test_replica_errors_are_grouped_with_their_replicas(wrong):
    nb = wrong[0]
    c = cell(nb, "raise")
    blocks, _ = summary(text_of(c), "1 done, 3 failed",
                        {0: "failed", 1: "done", 2: "failed", 3: "failed"})
    assert blocks[1][1] == ["replica 1 starts", "replica 1 finished"]
    for i in (0, 2):
        assert blocks[i][1] == [f"replica {i} starts", "ZeroDivisionError: division by zero"]
    assert blocks[3][1] == ["replica 3 starts", "ValueError: replica 3 found a bad batch"]
    error, shown = the_error(c)
    assert error["ename"] == "XlaSpawnError"
    assert error["evalue"].startswith(
        "3 of 4 replicas failed (ValueError, ZeroDivisionError)"), error["evalue"]
    # each distinct traceback once, headed by its replicas, with the cell's own lines
    assert shown.count("ZeroDivisionError: division by zero") == 1, shown
    assert re.search(r"\[replicas 0, 2\]\nTraceback.*\n.*Cell In\[\d+\], line 5", shown), shown
    assert re.search(r"\[replica 3\]\nTraceback.*\n.*Cell In\[\d+\], line 4", shown), shown
    assert text_of(cell(nb, "outcome")).splitlines() == [
        "XlaSpawnError", "failed: [0, 2, 3]",
        "states: {0: 'failed', 1: 'done', 2: 'failed', 3: 'failed'}"]


@pytest.mark.stacks("colab")
def test_replicas_waiting_in_rendezvous_are_stopped_soon_after_a_failure(wrong):
    nb, html_path, _ = wrong
    c = cell(nb, "rendezvous")
    blocks, took = summary(text_of(c), "1 failed, 3 stopped",
                           {0: "stopped", 1: "failed", 2: "stopped", 3: "stopped"})
    # 3 s of grace after replica 1 failed (the run's clock started before it failed), then
    # stopped: the "Stopped: stopped 3 s after replica 1 failed" lines below say it was the
    # fail-fast that ended the run, not a hang (that would be the notebook's timeout).
    assert took >= 3.0, took
    assert blocks[1][1] == ["replica 1: epoch 1 trained", "RuntimeError: replica 1 ran out of data"]
    for i in (0, 2, 3):  # each at the rendezvous, the line and call said (issue 33)
        assert blocks[i][1][0] == f"replica {i}: epoch 1 trained", blocks[i]
        assert re.fullmatch(
            r"Stopped: stopped 3 s after replica 1 failed \(RuntimeError\); at line 7: "
            r"`xm.rendezvous\(\"epoch-end\"\)` \(in rendezvous, torch_xla/core/xla_model.py:\d+\); "
            rf"last output: 'replica {i}: epoch 1 trained'; last xm.rendezvous: 'epoch-end'",
            blocks[i][1][1]), blocks[i]
        assert len(blocks[i][1]) == 2, blocks[i]
    error, shown = the_error(c)
    assert error["ename"] == "XlaSpawnError"
    assert error["evalue"].startswith(
        "1 of 4 replicas failed (RuntimeError); 3 were stopped (Stopped)"), error["evalue"]
    assert re.search(r"\[replica 1\]\nTraceback.*\n.*Cell In\[\d+\], line 6", shown), shown
    assert "epoch 2 started" not in text_of(c) + shown
    assert "last xm.rendezvous: 'epoch-end'" in visible_html(html_path)


@pytest.mark.stacks("colab")
def test_timeout_stops_a_hang(wrong):
    nb = wrong[0]
    c = cell(nb, "timeout")
    blocks, took = summary(text_of(c), f"{REPLICAS} stopped",
                           {i: "stopped" for i in range(REPLICAS)})
    # The --timeout counts from a few file operations (the run's log directory and record)
    # before the clock of T starts: 0.5 s is room for those under load, not an early stop.
    # That the timeout ended the run, not a hang, is the "Timeout:" lines below.
    assert took >= 3.0 - 0.5, took
    for i, (_, lines) in blocks.items():
        waiting = f"replica {i}: waiting for /nonexistent/ready"
        assert lines[0] == waiting and len(lines) == 2, (i, lines)
        # At the loop's sleep, or its check between two sleeps (caught inside the call
        # it makes there, the place names it too: "(in exists, <frozen genericpath>:19)").
        assert re.fullmatch(r"Timeout: still running after --timeout 3 s, so the run was "
                            r"stopped; at line (7: `time.sleep\(0.1\)`|6: `while not os.path."
                            r"exists\(\"/nonexistent/ready\"\):`( \(in exists, [^)]+\))?); "
                            rf"last output: '{re.escape(waiting)}'", lines[1]), (i, lines)
    error, _ = the_error(c)
    assert error["ename"] == "XlaSpawnError"
    assert error["evalue"].startswith("4 of 4 replicas were stopped (Timeout)"), error["evalue"]


@pytest.mark.stacks("colab")
def test_good_replicas_results_survive_a_failure(wrong):
    nb = wrong[0]
    c = cell(nb, "partial")
    blocks, _ = summary(text_of(c), "3 done, 1 failed",
                        {0: "done", 1: "done", 2: "done", 3: "failed"})
    for i in range(3):
        assert blocks[i][1] == [f"Out: {10.0 * i}"], blocks[i]
    assert blocks[3][1] == ["ValueError: replica 3: loss is NaN"]
    error, _ = the_error(c)
    assert error["evalue"].startswith("1 of 4 replicas failed (ValueError)"), error["evalue"]
    assert text_of(cell(nb, "partial-nb")).splitlines() == [
        "scores: {0: 0.0, 1: 10.0, 2: 20.0}", "failed: [3]"]


@pytest.mark.stacks("colab")
def test_a_run_after_the_failures_works_together(wrong):
    nb = wrong[0]
    blocks, _ = summary(text_of(cell(nb, "rerun")), f"{REPLICAS} done")
    for i, (_, lines) in blocks.items():
        assert lines == [f"replica {i}: sum over all replicas = 10.0", "Out: 10.0"], (i, lines)
    assert text_of(cell(nb, "rerun-nb")).strip() == "{0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}"


@pytest.mark.stacks("colab")
def test_doctor_reports_a_healthy_notebook(wrong):
    nb = wrong[0]
    shown = text_of(cell(nb, "doctor"))
    assert shown.startswith("colab_xla doctor\n"), shown
    for pattern in (r"running on +a local machine \(Linux", r"packages +torch \S+, torch_xla \S+",
                    r"device +CPU: \d+ replicas by default",
                    r"XLA runtime in this process +not initialized \(good\)",
                    r"leftover processes +0$"):
        assert re.search(pattern, shown, re.M), (pattern, shown)
    assert shown.rstrip().endswith("No problems found: %%xla_spawn should run here."), shown
