"""Errors a hostile cell makes, reported as what they are (issue #12), with real replicas."""

import re

import pytest

from _runs import run  # tests/ is on sys.path

from colab_xla.notebook.outcome import XlaSpawnError

pytestmark = [pytest.mark.xla, pytest.mark.timeout(180), pytest.mark.stacks("colab", "kaggle")]


def test_an_exception_whose_str_raises_is_reported_not_a_crash():
    outcome = run("class Odd(Exception):\n    def __str__(self):\n"
                  "        raise RuntimeError('no')\nraise Odd()", 2)
    assert outcome.failed == [0, 1]
    for rep in outcome.replicas.values():
        assert rep.error.kind == "exception" and rep.error.ename == "Odd", rep.error
        assert "str() failed" in rep.error.evalue
        assert "raise Odd()" in rep.error.render()  # the traceback, to the cell's line


def test_keyboard_interrupt_raised_by_the_cell_is_an_error_of_the_cell_not_an_interrupt():
    outcome = run("if index == 1:\n    raise KeyboardInterrupt('from the cell')\nindex", 2)
    assert not outcome.interrupted
    error = outcome.replicas[1].error
    assert error.kind == "exception" and error.ename == "KeyboardInterrupt"
    assert "line 3" in error.render() and "from the cell" in error.render()
    assert outcome.results() == {0: 0}


def test_an_exception_class_of_the_cell_reads_as_the_cell_wrote_it_and_groups():
    outcome = run("class B(Exception):\n    pass\nraise B('same on every replica')", n=3)
    groups = outcome.error_groups()
    assert [ordinals for _, ordinals in groups] == [[0, 1, 2]]
    text = groups[0][0].render()
    assert text.splitlines()[-1] == "B: same on every replica"
    assert "xla_cell_" not in text
    assert str(XlaSpawnError(outcome)).startswith("3 of 3 replicas failed (B)")


@pytest.mark.parametrize("simulate", ["processes", "threads"])
def test_os_exit_in_one_replica_names_that_replica_and_the_call(simulate):
    outcome = run("import os, time\nif index == 1:\n    os._exit(0)\ntime.sleep(30)", n=3,
                  simulate=simulate)
    died = outcome.replicas[1].error
    assert died.kind == "died"
    assert "replica 1 called os._exit(0)" in died.evalue
    for other in (0, 2):
        error = outcome.replicas[other].error
        if simulate == "threads":  # threads of the same process: they went with it
            assert "replica 1 called os._exit(0)" in error.evalue
        else:  # a process each: stopped soon after, as after any failure
            assert error.kind == "stopped"
            assert "after replica 1 failed (ReplicaDied)" in error.evalue
    assert "without an exit code" not in str(XlaSpawnError(outcome))


@pytest.mark.parametrize("simulate", ["processes", "threads"])
def test_an_xla_abort_names_the_signal_and_what_xla_said(simulate):
    outcome = run("import torch\ntorch.ones(2, device=device).sum().item()", 2,
                  env={"XLA_FLAGS": "--xla_bogus_flag"}, simulate=simulate)
    assert outcome.failed == [0, 1]
    if simulate == "threads":
        # XLA printed it while xmp.spawn started the runtime, before any replica ran.
        startup = outcome.processes["process start-up"].tail_text()
    else:  # each replica's process starts its runtime in the cell: its own output
        startup = "\n".join(rep.log.tail_text() for rep in outcome.replicas.values())
    assert "--xla_bogus_flag" in startup and "Fatal Python error: Aborted" in startup
    for rep in outcome.replicas.values():
        assert rep.error.kind == "died"
        assert "killed by SIGABRT" in rep.error.evalue
        # What XLA said (in its own words), quoted from its output, names the bad flag.
        said = re.search(r"XLA said: '([^']+)'", rep.error.evalue)
        assert said and "--xla_bogus_flag" in said.group(1), rep.error.evalue
        assert said.group(1) in startup, (said.group(1), startup)
