"""Benchmarks run as scripts from a process that has imported torch_xla already: what
``python bench/NAME.py ARGS`` does, without importing torch and torch_xla again for each
(~9 s of CPU each time, most of a smoke run of the smaller benchmarks).

``with WarmRunner() as runner: code = runner.run(script, args, out, err, timeout)``. The
runner is a child process that imports torch_xla as the notebook does (colab_xla's own
import, the environment left alone) and then, for each request, forks a child that runs
the script as ``__main__`` (its directory first on ``sys.path``, its ``argv``, its stdout
and stderr into files) and exits as the script would, atexit handlers and all. A child
still running at ``timeout`` is killed with its process group (it is its group's leader:
exactly what it started, never by name).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import List

_RUNNER = r'''
import json, os, runpy, sys, traceback
from colab_xla.notebook.torch_xla_import import import_torch_xla
import_torch_xla()
import colab_xla.notebook.targets  # (the benchmarks' own imports, once)
for line in sys.stdin:
    script, args, out, err = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdin = open(os.devnull)
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(script))
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            raise SystemExit(1)
        raise SystemExit(0)
    print(json.dumps(["started", pid]), flush=True)
    print(json.dumps(["ended", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])]), flush=True)
'''


class WarmRunner:
    def __enter__(self) -> "WarmRunner":
        self._proc = subprocess.Popen([sys.executable, "-c", _RUNNER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)
        return self

    def __exit__(self, *exc) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _reply(self, deadline: float):
        left = deadline - time.monotonic()
        if left > 0 and select.select([self._proc.stdout], [], [], left)[0]:
            line = self._proc.stdout.readline()
            if line:
                return json.loads(line)
            raise RuntimeError(f"the warm runner ended (exit {self._proc.wait()})")
        return None

    def run(self, script: str, args: List[str], out: str, err: str, timeout: float) -> int:
        """``script args``'s exit code (its output in ``out`` and ``err``); killed, with
        what it started in its group, and TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        self._proc.stdin.write(json.dumps([script, args, out, err]) + "\n")
        self._proc.stdin.flush()
        started = self._reply(time.monotonic() + 60)
        if started is None:
            raise TimeoutError("the warm runner did not fork the benchmark")
        ended = self._reply(deadline)
        if ended is None:
            os.killpg(started[1], signal.SIGKILL)
            self._reply(time.monotonic() + 30)  # (its "ended", once reaped)
            raise TimeoutError(f"{script} {args}: still running after {timeout} s")
        return ended[1]
