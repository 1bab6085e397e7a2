"""Output faults of issue #12 in real torch_xla CPU replicas (threads of one process):
each replica's own redirection, every way of writing, long lines, text progress bars."""

import os
import subprocess
import sys
import textwrap

import pytest

from _runs import run  # tests/ is on sys.path


pytestmark = [pytest.mark.xla, pytest.mark.timeout(300), pytest.mark.stacks("colab", "kaggle")]


def lines(outcome, ordinal, stream=None):
    return [t for s, t in outcome.replicas[ordinal].log.tail if stream in (None, s)]


def test_redirect_stdout_in_one_replica_captures_only_its_own_prints():
    outcome = run("""
        import contextlib, io, time
        buf = io.StringIO()
        if index == 0:
            with contextlib.redirect_stdout(buf):
                time.sleep(1)             # the others print while replica 0 redirects
                print("captured by replica 0")
                inside = sys.stdout is buf
        else:
            time.sleep(0.5)
            inside = None
        print(f"replica {index} reaches the notebook")
        (buf.getvalue(), inside)
        """, 3, user_ns={"sys": __import__("sys")})
    assert outcome.ok, outcome
    assert outcome.results()[0] == ("captured by replica 0\n", True)
    for o in range(3):
        assert lines(outcome, o) == [f"replica {o} reaches the notebook"], o


def test_a_replica_that_replaces_sys_stdout_keeps_it_to_itself():
    outcome = run("""
        import io, sys, time
        if index == 0:
            sys.stdout = io.StringIO()    # never restored
            print("into replica 0's StringIO")
            kept = sys.stdout.getvalue()
        else:
            time.sleep(1)
            kept = None
        print(f"replica {index} printed")
        sys.stderr.write(f"replica {index} warned\\n")
        kept
        """, 2)
    assert outcome.ok, outcome
    assert outcome.results()[0] == "into replica 0's StringIO\n"
    assert lines(outcome, 0) == ["replica 0 warned"]
    assert lines(outcome, 1) == ["replica 1 printed", "replica 1 warned"]


def test_every_way_of_writing_reaches_the_replicas_own_log():
    outcome = run("""
        import logging, os, sys
        print(f"dunder {index}", file=sys.__stdout__)
        sys.stdout.buffer.write(f"bytes {index} caf".encode() + b"\\xc3")
        sys.stdout.buffer.write(b"\\xa9 \\xff\\n")          # a character split in two
        log = logging.getLogger(f"cell{index}")
        log.addHandler(logging.StreamHandler())             # made inside the cell
        log.warning(f"logged {index}")
        sys.stdout.flush()
        None
        """, 2)
    assert outcome.ok, outcome
    for o in range(2):
        assert lines(outcome, o, "stdout") == [f"dunder {o}", f"bytes {o} café \ufffd"]
        assert lines(outcome, o, "stderr") == [f"logged {o}"]


def test_os_write_to_fd_1_reaches_the_notebook_decoded_across_reads():
    outcome = run("""
        import os, time
        os.write(1, b"straight to fd 1\\n")
        os.write(1, b"caf\\xc3")
        time.sleep(0.3)                   # the notebook reads the first half alone
        os.write(1, b"\\xa9 \\xff\\n")
        None
        """, 1)
    assert outcome.ok, outcome
    assert lines(outcome, 0) == ["straight to fd 1", "café \ufffd"]


def test_a_50_mib_line_without_newline_arrives_whole():
    outcome = run("""
        import sys
        sys.stdout.write("y" * (50 << 20))
        None
        """, 1)
    assert outcome.ok, outcome
    [line] = lines(outcome, 0)
    assert len(line) == 50 << 20 and set(line) == {"y"}



def test_tqdm_notebook_in_a_replica_is_the_text_bar():
    pytest.importorskip("tqdm")
    outcome = run("""
        from tqdm.notebook import tqdm, trange
        for _ in tqdm(range(3), desc=f"bar{index}", mininterval=0):
            pass
        type(tqdm).__module__, tqdm.__module__
        """, 2)
    assert outcome.ok, outcome
    for o in range(2):
        assert outcome.results()[o][1] == "tqdm.std"
        assert any(f"bar{o}: 100%" in t and "3/3" in t for t in lines(outcome, o, "stderr")), \
            lines(outcome, o)


@pytest.mark.stacks("kaggle")
@pytest.mark.timeout(300)
def test_master_print_reaches_the_replica_whatever_stdout_was_when_torch_xla_was_imported():
    # xm.master_print binds sys.stdout as its default when torch_xla is first imported: in a
    # notebook, a stream the replicas do not write through (or, here, one closed since).
    probe = textwrap.dedent("""
        import io, sys
        real, sys.stdout = sys.stdout, io.StringIO()
        import torch_xla.core.xla_model
        sys.stdout.close()
        sys.stdout = real
        from colab_xla.notebook.targets import run_cell
        outcome = run_cell("import torch_xla.core.xla_model as xm\\nxm.master_print('hello')",
                           replicas=2, announce=None)
        print(repr(outcome.replicas[0].text), outcome.ok)
        """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=280, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert out.stdout.strip().splitlines()[-1:] == ["'hello' True"], out.stderr[-2000:]
