"""The magic's line in a real kernel: quoted values reach the replicas as a shell would pass
them, and a line that cannot be split is a UsageError, not a traceback (issue #12)."""

from __future__ import annotations

import pytest

from _kernel import kernel_fixture  # tests/ is on sys.path

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300), pytest.mark.stacks("colab")]


kernel = kernel_fixture()


def test_a_quoted_env_value_with_spaces_reaches_every_replica_and_xla(kernel, tmp_path):
    dump = tmp_path / "dump"
    flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
    k = kernel
    reply = k.run(f'%%xla_spawn -n 2 --no-widget -o seen --env XLA_FLAGS="{flags}"\n'
                  "import os, torch\n"
                  "print('XLA_FLAGS is', os.environ['XLA_FLAGS'])\n"
                  "(torch.ones(3, device=device) * index).sum().item()\n"
                  "os.environ['XLA_FLAGS']")
    assert reply.status == "ok", reply.text
    for ordinal in (0, 1):
        assert f"[replica {ordinal}] XLA_FLAGS is {flags}\n" in reply.stdout, reply.text
    check = k.run(f"assert seen == {{0: {flags!r}, 1: {flags!r}}}, seen")
    assert check.status == "ok", check.text
    assert any(dump.iterdir())  # XLA read both flags: it dumped what it compiled


def test_an_unclosed_quote_is_a_usage_error_and_the_kernel_goes_on(kernel):
    k = kernel
    reply = k.run('%%xla_spawn -n 2 --no-widget --env XLA_FLAGS="--xla_a\nindex')
    assert reply.status == "error" and reply.ename == "UsageError", reply.text
    assert 'the " at column 34 opens a quoted value that is never closed' in reply.evalue
    assert "Traceback" not in reply.text and "ValueError" not in reply.text
    again = k.run("%%xla_spawn -n 2 --no-widget -o r\nindex")
    assert again.status == "ok", again.text
