"""Notebooks run in a real kernel (nbclient), and what they show is what they should show.

The tutorial runs once (module fixture); the tests read its executed copy: each replica's
own lines under its own heading, results used in later cells, the plain-xmp.spawn failures
it demonstrates, and the HTML rendering. A second test runs a notebook whose replicas
raise through ``run_notebooks.main`` and checks that it fails loudly but keeps the output.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import nbformat  # the test command installs every layer's tools: a missing one fails

import run_notebooks  # noqa: E402  (tools/ is on sys.path: conftest.py)

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(600), pytest.mark.stacks("colab")]

TUTORIAL = run_notebooks.NOTEBOOKS_DIR / "01-hello-replicas.ipynb"
REPLICAS = 4
TIMEOUT = 240  # per cell


# --- reading an executed notebook ---------------------------------------------------------


def cell(nb, cell_id):
    matches = [c for c in nb.cells if c.get("id") == cell_id]
    assert len(matches) == 1, f"no single cell with id {cell_id!r}"
    return matches[0]


def text_of(c) -> str:
    """What the cell showed as text: its streams and the text/plain of its results."""
    parts = []
    for out in c.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def errors_of(c):
    return [out for out in c.get("outputs", []) if out["output_type"] == "error"]


def assert_every_cell_ran(nb, may_raise=()):
    """Every code cell executed; only the cells whose ids are in ``may_raise`` raised."""
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.execution_count is not None, c.id  # Run All went past expected failures
            if c.id in may_raise:
                assert len(errors_of(c)) == 1, (c.id, "should raise")
            else:
                assert not errors_of(c), (c.id, errors_of(c))


def replica_blocks(text: str):
    """``{ordinal: (heading, [lines under it])}`` of a %%xla_spawn summary."""
    blocks, current = {}, None
    for line in text.splitlines():
        m = re.match(r"── replica (\d+) ", line)
        if m:
            current = int(m.group(1))
            blocks[current] = (line, [])
        elif line.startswith("── "):
            current = None
        elif current is not None:
            blocks[current][1].append(line)
    return blocks


def assert_summary(text: str, expected_lines):
    """A finished run of REPLICAS replicas; replica i shows exactly expected_lines(i)."""
    assert re.search(rf"^{REPLICAS} replicas on CPU: {REPLICAS} done in \d+\.\d\d s"
                     r"( · results in `\w+`)?$", text,
                     re.M), text
    blocks = replica_blocks(text)
    assert sorted(blocks) == list(range(REPLICAS)), text
    for i in range(REPLICAS):
        heading, lines = blocks[i]
        assert re.fullmatch(rf"── replica {i} · done · \d+\.\d\d s", heading), heading
        assert lines == expected_lines(i), (i, lines)


# --- the tutorial ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    out = tmp_path_factory.mktemp("notebooks")
    nb, html_path, ipynb_path = run_notebooks.execute_notebook(TUTORIAL, out, TIMEOUT)
    return nb, html_path, ipynb_path


def test_tutorial_is_saved_clean():
    nb = nbformat.read(TUTORIAL, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, c.id


def test_tutorial_runs_without_errors(tutorial):
    nb, _, ipynb_path = tutorial
    assert ipynb_path.exists()
    assert_every_cell_ran(nb)


def test_every_replica_says_hello(tutorial):
    nb = tutorial[0]
    assert_summary(text_of(cell(nb, "hello")), lambda i: [f"hello from replica {i}"])


def test_replica_sees_index_world_size_and_device(tutorial):
    nb = tutorial[0]
    assert_summary(text_of(cell(nb, "replica")), lambda i: [
        f"replica {i} of {REPLICAS} on xla:0: x.sum() = {4.0 * i}"])


def test_results_come_back_with_dash_o(tutorial):
    nb = tutorial[0]
    assert_summary(text_of(cell(nb, "squares")), lambda i: [f"Out: {float(i * i)}"])
    used = text_of(cell(nb, "use-squares"))
    assert "{0: 0.0, 1: 1.0, 2: 4.0, 3: 9.0}" in used
    assert f"sum of squares over {REPLICAS} replicas: 14.0" in used


def test_notebook_functions_and_classes_work_in_replicas(tutorial):
    nb = tutorial[0]

    def expected(i):
        items = list(range(i, 12, REPLICAS))
        mean = sum(x * x for x in items) / len(items)
        return [f"replica {i}: items {items}, mean of squares {mean:.2f}",
                f"Out: {(len(items), mean)!r}"]

    assert_summary(text_of(cell(nb, "stats")), expected)
    assert "all replicas: 12 items, mean of squares 42.17" in text_of(cell(nb, "use-stats"))


def test_plain_xmp_spawn_failures_are_shown(tutorial):
    nb = tutorial[0]
    nprocs = text_of(cell(nb, "nprocs-demo"))
    assert nprocs.startswith("ValueError: Unsupported nprocs (8)."), nprocs
    pickling = text_of(cell(nb, "pickle-demo")).splitlines()
    assert len(pickling) == 2, pickling
    assert re.match(r"PicklingError: Can't pickle <function <lambda>", pickling[0]), pickling
    # Python 3.13 says "Can't get local object", earlier ones "Can't pickle local object".
    assert re.fullmatch(r"AttributeError: Can't (pickle|get) local object "
                        r"'make_mp_fn\.<locals>\._mp_fn'", pickling[1]), pickling
    # ...and neither initialized XLA in the kernel: replicas still start afterwards.
    assert text_of(cell(nb, "runtime-check")).strip().endswith(": False")
    assert_summary(text_of(cell(nb, "after")), lambda i: [f"replica {i} still starts fine"])


def test_html_rendering_has_the_per_replica_summary(tutorial):
    # What a reader of the HTML sees without JavaScript: not inside <script> (widget state
    # embedded there is only drawn if a widget manager loads from the network).
    _, html_path, _ = tutorial
    html = html_path.read_text(encoding="utf-8")
    visible = re.sub(r"<script\b.*?</script>", "", html, flags=re.S | re.I)
    assert f"{REPLICAS} replicas on CPU: {REPLICAS} done in" in visible
    for i in range(REPLICAS):
        assert f"hello from replica {i}" in visible, f"replica {i}'s output is not in the HTML"


# --- a failing notebook ---------------------------------------------------------------------


def test_failing_notebook_exits_nonzero_and_keeps_its_output(tmp_path, capsys):
    v4 = nbformat.v4
    nb = v4.new_notebook(cells=[
        v4.new_code_cell("%load_ext colab_xla", id="load"),
        v4.new_code_cell('%%xla_spawn -n 2\nprint(f"replica {index} before the error")\n'
                         'raise ValueError("boom")', id="boom"),
        v4.new_code_cell('print("not reached")', id="after"),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                "language": "python"}})
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    out = tmp_path / "out"

    code = run_notebooks.main([str(path), "--out", str(out), "--timeout", str(TIMEOUT)])

    assert code != 0
    report = capsys.readouterr().out
    assert re.search(r"^FAILED +broken\.ipynb .*\(cell 2 of 3: XlaSpawnError: "
                     r"2 of 2 replicas failed \(ValueError\)\)$", report, re.M), report
    executed = nbformat.read(out / "broken.ipynb", as_version=4)
    assert (out / "broken.html").exists()
    boom = cell(executed, "boom")
    [error] = errors_of(boom)
    assert error["ename"] == "XlaSpawnError"
    shown = "\n".join(error["traceback"])
    assert "[replicas 0-1]" in shown, shown
    assert re.search(r"Cell In\[\d+\], line 3", shown), shown
    assert "ValueError: boom" in shown, shown
    # the per-replica summary printed before the error is kept too
    summary = text_of(boom)
    assert "2 replicas on CPU: 2 failed" in summary, summary
    for i in range(2):
        assert f"replica {i} before the error" in replica_blocks(summary)[i][1]
    assert cell(executed, "after").execution_count is None


def test_kernels_are_reached_over_ipc_and_start_without_a_transport_warning(tmp_path, capfd):
    """The runner's kernels listen on Unix sockets in a private directory, removed when the
    notebook is done: over TCP, ipykernel 7 warns on stderr at each start that the kernel
    runs "over TCP without encryption" (once per notebook of scripts/run-notebooks)."""
    v4 = nbformat.v4
    probe = ("import os\nfrom ipykernel.kernelapp import IPKernelApp\n"
             "app = IPKernelApp.instance()\n"
             "where = os.path.dirname(app.connection_file)\n"
             "print(app.transport, app.connection_file, oct(os.stat(where).st_mode & 0o777),\n"
             "      app.ip.startswith(where + os.sep))")
    nb = v4.new_notebook(cells=[v4.new_code_cell(probe, id="probe")],
                         metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                  "language": "python"}})
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)

    executed, _, _ = run_notebooks.execute_notebook(path, tmp_path / "out", TIMEOUT)

    transport, connection_file, mode, sockets_there = text_of(cell(executed, "probe")).split()
    assert (transport, mode, sockets_there) == ("ipc", "0o700", "True")
    assert not Path(connection_file).parent.exists()  # removed with its sockets
    err = capfd.readouterr().err
    assert "TCP" not in err and "encryption" not in err, err
