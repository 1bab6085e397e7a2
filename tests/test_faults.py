"""Fault injection in real kernels: what a hostile (or unlucky) user does, and what must
hold afterwards. Each test failed before the fix it guards (issue #12)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from _kernel import Kernel, shell_msg_ready, wait_until_gone  # tests/ is on sys.path

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def wait_for_files(paths, timeout: float = 120, kernel: Kernel = None, msg_id=None):
    """Poll until every path exists with content (a replica wrote it); their contents."""
    deadline = time.monotonic() + timeout
    while not all(Path(p).exists() and Path(p).read_text() for p in paths):
        if kernel is not None and shell_msg_ready(kernel.kc):
            reply = kernel.wait(msg_id)
            pytest.fail(f"the cell ended before its replicas wrote {paths}:\n{reply.text}")
        assert time.monotonic() < deadline, f"no replica wrote {paths} in {timeout} s"
        time.sleep(0.05)
    return [Path(p).read_text() for p in paths]


def pid_cell(tmp_path, line: str, then: str = "time.sleep(600)") -> str:
    """A cell whose replicas write their pid to tmp_path/pid<index>, then do ``then``."""
    return (f"%%xla_spawn {line}\nimport os, time\n"
            f"open({str(tmp_path)!r} + f'/pid{{index}}', 'w').write(str(os.getpid()))\n{then}")


@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_everything_a_run_started_dies_with_a_killed_kernel(tmp_path, start_method):
    with Kernel() as k:
        assert k.run("%load_ext colab_xla").status == "ok"
        msg_id = k.submit(pid_cell(tmp_path, f"-n 2 --no-widget --start-method {start_method}"))
        pids = [int(p) for p in wait_for_files([tmp_path / "pid0", tmp_path / "pid1"],
                                               kernel=k, msg_id=msg_id)]
        started = k.descendants()  # replicas, and for forkserver the server and its tracker
        assert {p for p in pids} <= {p.pid for p in started}
        k.kill()
        alive = wait_until_gone(started, timeout=20)
        assert alive == [], [(p.pid, " ".join(p.cmdline())[:120]) for p in alive]
