"""A real ipykernel driven by jupyter_client, for tests of what happens inside a kernel.

``with Kernel() as k:`` starts one (PYTEST_CURRENT_TEST removed from its environment:
ipykernel turns its fd capture off when it sees it), reached over IPC in a private temporary
directory as run_notebooks starts its kernels (no TCP, no warning about it), and shuts it
down afterwards, killing exactly the processes it started that are still alive (by pid,
never by name).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import queue
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import pytest
import zmq
from jupyter_client import KernelManager
from run_notebooks import ipc_connection  # tools/ is on sys.path (conftest.py)


def shell_msg_ready(kc) -> bool:
    """Whether a shell reply waits for ``kc`` (a blocking client), without reading it.
    jupyter_client 7 (Colab's) gives the blocking client async channels, whose msg_ready()
    is a coroutine, truthy without being awaited: poll the socket itself there."""
    ready = kc.shell_channel.msg_ready()
    if inspect.iscoroutine(ready):
        ready.close()
        return bool(zmq.Socket.shadow(kc.shell_channel.socket.underlying).poll(0))
    return bool(ready)


@dataclass
class Reply:
    status: str
    ename: Optional[str] = None
    evalue: Optional[str] = None
    traceback: List[str] = field(default_factory=list)
    stdout: str = ""  # stream output of the cell (stdout and stderr)
    data: List[Dict] = field(default_factory=list)  # display_data / execute_result bundles

    @property
    def text(self) -> str:
        """Everything a person would read: streams, text/plain of displays, the error."""
        plain = "".join(d.get("text/plain", "") + "\n" for d in self.data)
        return self.stdout + plain + f"{self.ename}: {self.evalue}\n" + "\n".join(self.traceback)


@contextlib.contextmanager
def loaded_kernel(env: Optional[Dict[str, str]] = None):
    """A :class:`Kernel` (``env``: see it) with ``%load_ext colab_xla`` run in it."""
    with Kernel(env=env) as k:
        assert k.run("%load_ext colab_xla").status == "ok"
        yield k


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


def kernel_fixture(env: Optional[Dict[str, str]] = None):
    """The ``kernel`` fixture of a test module: one :func:`loaded_kernel` (``env``: see
    :class:`Kernel`) for the module's tests in turn (a kernel's first run costs ~9 s of CPU,
    most of it importing torch_xla)."""

    @pytest.fixture(scope="module", name="kernel")
    def kernel():
        with loaded_kernel(env=env) as k:
            yield k

    return kernel


def session_pids_in(reply_text: str) -> List[int]:
    """The pids of the replicas a ``%xla_session`` reply names, sorted."""
    return sorted(int(p) for p in re.findall(r"replica \d+: pid (\d+)", reply_text))


class Kernel:
    def __init__(self, env: Optional[Dict[str, str]] = None, kernel_name: str = "python3"):
        kernel_env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        kernel_env.update(env or {})
        self._env, self._name = kernel_env, kernel_name
        self.km: Optional[KernelManager] = None

    def __enter__(self) -> "Kernel":
        self._ipc = contextlib.ExitStack()
        self.km = KernelManager(kernel_name=self._name,
                                **self._ipc.enter_context(ipc_connection()))
        self.km.start_kernel(env=self._env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.process = psutil.Process(self.km.provisioner.process.pid)
        self._seen: set = set()
        return self

    def __exit__(self, *exc) -> None:
        started = self.descendants()
        with contextlib.suppress(Exception):
            self.kc.stop_channels()
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=True)
        for proc in started:  # whatever outlived the kernel: ours, by pid and start time
            with contextlib.suppress(psutil.Error):
                proc.kill()
        self._ipc.close()  # the connection file's and sockets' directory

    # -- running code ---------------------------------------------------------------------

    def submit(self, code: str) -> str:
        """Start ``code`` without waiting; the message id."""
        self.descendants()
        return self.kc.execute(code, stop_on_error=False)

    def began(self, msg_id: str, timeout: float = 60) -> None:
        """Wait until the kernel has begun running ``msg_id``'s cell (its busy status on
        iopub): an Interrupt sent before then would find it idle, not in the cell."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "busy"):
                return

    def wait(self, msg_id: str, timeout: float = 180, *, first: bool = False) -> Reply:
        """The reply to ``msg_id`` and everything the cell printed or displayed.
        ``first``: see :meth:`reply`."""
        deadline = time.monotonic() + timeout
        return self.outputs(msg_id, self.reply(msg_id, timeout, first=first),
                            max(1.0, deadline - time.monotonic()))

    def reply(self, msg_id: str, timeout: float = 180, *, first: bool = False) -> Reply:
        """The reply to ``msg_id`` (status and error), without reading what the cell showed
        (:meth:`outputs` reads that). Replies to other requests are passed over, unless
        ``first``: then the next reply must be this one (an AssertionError says what came
        instead). Either way the kernel_info_replies to the requests ``wait_for_ready``
        repeats each second the kernel is not ready (they arrive late, before the first
        execute_reply) are passed over."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
            if msg["msg_type"] == "kernel_info_reply":
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                reply = msg["content"]
                return Reply(reply["status"], reply.get("ename"), reply.get("evalue"),
                             reply.get("traceback", []))
            assert not first, (f"{msg['msg_type']} to another request ({msg['content']}) "
                               f"came before the reply to {msg_id}")

    def outputs(self, msg_id: str, reply: Reply, timeout: float = 180) -> Reply:
        """``reply`` with everything the cell of ``msg_id`` printed or displayed: its iopub
        messages up to its idle status."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                reply.stdout += content["text"]
            elif kind in ("display_data", "update_display_data", "execute_result"):
                reply.data.append(content["data"])
            elif kind == "status" and content["execution_state"] == "idle":
                return reply

    def run(self, code: str, timeout: float = 180, *, first: bool = False) -> Reply:
        return self.wait(self.submit(code), timeout, first=first)

    def complete(self, code: str, timeout: float = 30) -> List[str]:
        """What a ``complete_request`` at the end of ``code`` offers, as the code each
        match would make."""
        content = self._complete_reply(code, timeout)
        return [code[:content["cursor_start"]] + m for m in content["matches"]]

    def completion_types(self, code: str, timeout: float = 30) -> Dict[str, str]:
        """``{code a match would make: its type}``, as JupyterLab reads them (the reply's
        ``_jupyter_types_experimental``)."""
        content = self._complete_reply(code, timeout)
        return {code[:c["start"]] + c["text"]: c.get("type")
                for c in content.get("metadata", {}).get("_jupyter_types_experimental", [])}

    def _complete_reply(self, code: str, timeout: float) -> dict:
        msg_id = self.kc.complete(code, len(code))
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg["content"]

    def run_answering(self, code: str, answers, timeout: float = 180):
        """Run ``code`` with the notebook's input box on (``allow_stdin``), answering each
        input request the kernel sends with the next of ``answers``, as a person typing;
        the reply, and the prompts asked."""
        msg_id = self.kc.execute(code, allow_stdin=True, stop_on_error=False)
        answers, prompts = list(answers), []
        deadline = time.monotonic() + timeout
        while True:
            try:
                request = self.kc.get_stdin_msg(timeout=0.2)
            except queue.Empty:
                request = None
            if request is not None and request["msg_type"] == "input_request":
                prompts.append(request["content"]["prompt"])
                assert answers, f"asked {request['content']['prompt']!r} with no answer left"
                self.kc.input(answers.pop(0))
                continue
            with contextlib.suppress(queue.Empty):
                msg = self.kc.get_shell_msg(timeout=0.05)
                if msg["parent_header"].get("msg_id") == msg_id:
                    content = msg["content"]
                    reply = Reply(content["status"], content.get("ename"),
                                  content.get("evalue"), content.get("traceback", []))
                    return self.outputs(msg_id, reply), prompts
            assert time.monotonic() < deadline, f"no reply within {timeout} s; asked {prompts}"

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def kill(self) -> None:
        """SIGKILL the kernel's process, as a crash or the OOM killer would."""
        self.descendants()
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    # -- its processes --------------------------------------------------------------------

    def descendants(self) -> List[psutil.Process]:
        """Every process the kernel has started so far (remembered, also once orphaned)."""
        with contextlib.suppress(psutil.Error):
            for proc in self.process.children(recursive=True):
                self._seen.add(proc)
        return [p for p in self._seen if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until_gone(procs, timeout: float) -> List[psutil.Process]:
    """Wait up to ``timeout`` for ``procs`` to end; those still alive then."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _alive(p)]
    return alive


def replicas_left(outcome, timeout: float = 10) -> List[psutil.Process]:
    """The processes of ``outcome``'s replicas still alive ``timeout`` s from now."""
    return wait_until_gone([psutil.Process(r.pid) for r in outcome.replicas.values()
                            if r.pid and psutil.pid_exists(r.pid)], timeout=timeout)
