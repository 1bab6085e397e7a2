"""``%xla_session`` in a real kernel: the notebook's Interrupt keeps the session and its
state, and a killed kernel leaves none of its processes.

The tests but the killed kernel's share one kernel (each of its first cells costs ~9 s of
CPU, most of it importing torch_xla): each starts the session it needs and stops it."""

from __future__ import annotations

import contextlib
import re

import pytest

from _kernel import (Kernel, kernel_fixture, session_pids_in,  # tests/ is on sys.path
                     wait_for_files, wait_until_gone)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300), pytest.mark.stacks("colab")]


kernel = kernel_fixture(env={"COLAB_XLA_VIEW": "text"})


@contextlib.contextmanager
def session_kernel(k: Kernel, replicas: int, start: str = ""):
    """A session of ``replicas`` started in ``k`` (the start's reply), stopped afterwards."""
    started = k.run(f"%xla_session start -n {replicas} {start}".rstrip())
    assert started.status == "ok", started.text
    try:
        yield started
    finally:
        stopped = k.run("%xla_session stop")
        assert stopped.status == "ok", stopped.text


@pytest.mark.parametrize("replicas, wait", [(2, "time.sleep(600)"), (1, "time.sleep(600)"),
                                           (1, "while True:\n    pass")])
def test_an_interrupt_stops_the_cell_and_keeps_the_session_and_its_state(kernel, tmp_path,
                                                                          replicas, wait):
    """At N=1 the replica ran in a thread of torch_xla's (xmp.spawn's one CPU process): a
    sleep there cannot be interrupted, and every Interrupt ended the session (issue 31)."""
    with session_kernel(kernel, replicas) as started:
        pids = session_pids_in(started.stdout)
        assert len(pids) == replicas
        assert kernel.run("%%xla_spawn --no-widget\nstate = index * 7").status == "ok"
        msg_id = kernel.submit("%%xla_spawn --no-widget\nimport os, time\n"
                               f"open({str(tmp_path)!r} + f'/in{{index}}', 'w').write('x')\n"
                               f"{wait}")
        wait_for_files([tmp_path / f"in{i}" for i in range(replicas)], kernel=kernel,
                       msg_id=msg_id)
        kernel.interrupt()
        interrupted = kernel.wait(msg_id, timeout=60)
        assert interrupted.ename == "KeyboardInterrupt", interrupted.text
        assert "the session ended" not in interrupted.text
        assert "did not stop" not in interrupted.text
        kept = kernel.run("%%xla_spawn --no-widget -o got\nstate")
        assert kept.status == "ok", kept.text
        status = kernel.run("%xla_session")
        assert session_pids_in(status.stdout) == pids, status.text
        assert kernel.run("print(got)").stdout.strip() == str({i: 7 * i for i in range(replicas)})


def test_a_killed_kernel_leaves_no_session_process():
    with Kernel() as k:
        assert k.run("%load_ext colab_xla").status == "ok"
        started = k.run("%xla_session start -n 2")
        assert started.status == "ok", started.text
        assert k.run("%%xla_spawn --no-widget\nx = index").status == "ok"
        procs = k.descendants()
        assert set(session_pids_in(started.stdout)) <= {p.pid for p in procs}
        k.kill()
        alive = wait_until_gone(procs, timeout=20)
        assert alive == [], [(p.pid, " ".join(p.cmdline())[:120]) for p in alive]


def test_auto_mode_in_a_kernel_keeps_state_on_the_replicas_and_off_runs_in_the_notebook(kernel):
    with session_kernel(kernel, 2, "--auto") as started:
        assert "auto: on" in started.stdout, started.text
        # Three cells without a magic, on the replicas, one building on the other.
        assert kernel.run("total = index").status == "ok"
        assert kernel.run("total += 10").status == "ok"
        shown = kernel.run("print('total', total)")
        assert shown.status == "ok", shown.text
        assert "[replica 0] total 10" in shown.text and "[replica 1] total 11" in shown.text
        # name? shows the replica's object (the notebook has no `total`).
        asked = kernel.run("total?")
        assert asked.status == "ok", asked.text
        plain = re.sub(r"\x1b\[[0-9;]*m", "", asked.text)  # (the inspector's colours)
        assert re.search(r"\[replica 1\] Type: +int", plain), plain
        assert re.search(r"\[replica 1\] String form: +11", plain), plain
        assert "not found" not in plain
        off = kernel.run("%xla_session auto off")
        assert "auto: off" in off.stdout, off.text
        here = kernel.run("print('total' in dir())")
        assert here.stdout.strip() == "False", here.text  # the notebook never had it


def test_a_kernels_complete_request_offers_a_replica_name_and_its_objects_attribute(kernel):
    with session_kernel(kernel, 2):
        defined = kernel.run("%%xla_spawn\nimport types\nnet = types.SimpleNamespace("
                             "fc=types.SimpleNamespace(weight_decay=1))")
        assert defined.status == "ok", defined.text
        assert "net" in kernel.complete("ne"), kernel.complete("ne")
        assert "net.fc.weight_decay" in kernel.complete("net.fc.we")
        # Typed as JupyterLab shows them (issue 55: `<unknown>`), where IPython's matcher
        # API v2 can say it (8.6 and later; IPython 7, Colab's, has them untyped).
        assert kernel.run("%%xla_spawn\nimport json as json_mod\ndef a_fn():\n    pass"
                          ).status == "ok"
        kinds = kernel.completion_types("json_mo") | kernel.completion_types("a_f")
        assert {"json_mod", "a_fn"} <= set(kinds), kinds
        from IPython.core import completer

        if hasattr(completer, "context_matcher"):
            assert kinds["json_mod"] == "module" and kinds["a_fn"] == "function", kinds


def test_what_a_session_replica_displays_reaches_the_cells_view(kernel):
    # (In a kernel: a terminal shell's display formatter makes text/plain only.)
    with session_kernel(kernel, 2):
        shown = kernel.run("%%xla_spawn --targets 1\nfrom IPython.display import HTML, "
                           "display\ndisplay(HTML('<i>shown</i>'))")
        assert shown.status == "ok", shown.text
        assert "[replica 1] [a display: text/html]" in shown.stdout, shown.text
        assert "[replica 1] (displayed text/html: the widget view" in shown.stdout


def test_targets_in_a_kernel_run_the_chosen_replicas_only(kernel):
    with session_kernel(kernel, 3):
        assert kernel.run("%%xla_spawn\nseen = 0").status == "ok"
        chosen = kernel.run("%%xla_spawn --targets 0,2\nseen += 1\nprint('ran on', index)")
        assert chosen.status == "ok", chosen.text
        assert "[replica 0] ran on 0" in chosen.text and "[replica 2] ran on 2" in chosen.text
        assert "replica 1" not in chosen.text, chosen.text
        after = kernel.run("%%xla_spawn -o got\nseen")
        assert after.status == "ok", after.text
        assert kernel.run("print(got)").stdout.strip() == "{0: 1, 1: 0, 2: 1}"
