"""``%xla_debug``: a post-mortem debugger (pdb) on a session replica's last exception,
driven from the notebook, IPython-free.

The replica runs pdb itself, between cells, on the exception its last cell raised (its
frames and locals are alive there: :func:`colab_xla.replica.serve.debug`); this module is
the notebook's end of the conversation, through two named pipes of the session's directory
(on a cluster's host, its agent's end, relayed to the notebook: :class:`Relayed`):
what pdb writes is shown as it comes, and at each prompt the person's answer is asked for
(``ask``: the notebook's input box, ipykernel's ``input``) and sent. It ends when pdb ends
(``q``, ``c``), or when the replica does not answer within :data:`ANSWER_SECONDS`; the
session goes on either way.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..errors import SetupError
from ..wire import pdb_pipes

# How long pdb may take to answer one command (``p`` of something slow, say) before the
# debugger is left: the replica gets the end of its input and serves cells again.
ANSWER_SECONDS = 60.0


class DebugError(SetupError):
    """Nothing to debug, or no replica to debug it in (the message says why)."""


def chosen(asked: Optional[int], failed, replicas) -> int:
    """The replica ``%xla_debug`` debugs: ``asked``, else the lowest that failed in the
    session's last cell (``failed``); one of ``replicas``."""
    if asked is None:
        if not failed:
            raise DebugError("no replica failed in this session's last cell: "
                             "%xla_debug R debugs replica R's last exception, if it had one.")
        return min(failed)
    if asked not in replicas:
        raise DebugError(f"%xla_debug {asked}: this session's replicas are "
                         f"{min(replicas)}-{max(replicas)}.")
    return asked


def opening(replica: str) -> str:
    """The line that says which replica's debugger opens (``replica``: "replica 2")."""
    return f"colab_xla: pdb on {replica}'s last exception (q ends it; the session goes on).\n"


def converse(answers_path: str, output_path: str, ask: Callable[[str], str],
             show: Callable[[str], None], answer_seconds: float = ANSWER_SECONDS) -> str:
    """The notebook's end of one debugger: what it writes to ``output_path`` is shown
    (``show``), each prompt asked (``ask``) and answered through ``answers_path``, until
    the replica closes its end; how it ended (``"ended"``, or why it was left)."""
    deadline = time.monotonic() + answer_seconds
    # The replica opens its output (for writing), then its answers (for reading): the
    # output's reader is here first, and the answers' writer waits for their reader.
    out = _open(output_path, os.O_RDONLY, deadline)
    answers: Optional[int] = None
    try:
        answers = _open(answers_path, os.O_WRONLY, deadline)
        pending = ""
        while True:
            ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return f"the replica did not answer within {answer_seconds:g} s"
            data = os.read(out, 65536)
            if not data:  # pdb closed its end: it is over
                show(pending)
                return "ended"
            pending += data.decode("utf-8", "replace")
            prompted = pdb_pipes.split_prompt(pending)
            if prompted is not None:  # ("(Pdb) ", or "ipdb> " where pdb is IPython's)
                shown, prompt = prompted
                show(shown)
                pending = ""
                line = ask(prompt)
                os.write(answers, (line.rstrip("\n") + "\n").encode())
                deadline = time.monotonic() + answer_seconds
            elif "\n" in pending:
                done, _, pending = pending.rpartition("\n")
                show(done + "\n")
    finally:
        os.close(out)
        if answers is not None:
            with contextlib.suppress(OSError):
                os.close(answers)  # (pdb reads the end of its input: it quits)


def _open(path: str, flags: int, deadline: float) -> int:
    """Open a named pipe without blocking; a writer's open waits (until ``deadline``) for
    its reader."""
    while True:
        try:
            return os.open(path, flags | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            if time.monotonic() >= deadline:
                raise DebugError("the replica did not open its debugger in time (is its "
                                 "process alive? %xla_session shows it); the session goes "
                                 "on.") from None
            time.sleep(0.01)


class Relayed:
    """A debugger run on a cluster's host for the notebook: its session's
    :meth:`~colab_xla.notebook.targets.session.Session.debug` in a thread of the host's
    agent, each prompt handed to the notebook (:meth:`step` returns at the next prompt or
    at the end) and each answer back from it."""

    def __init__(self, run: Callable[[Callable[[str], str], Callable[[str], None]], str]):
        self._lock = threading.Condition()
        self._output: List[str] = []
        self._prompt: Optional[str] = None
        self._answers: "queue.Queue[str]" = queue.Queue()
        self._ended: Optional[str] = None
        threading.Thread(target=self._run, args=(run,), name="colab_xla-debug",
                         daemon=True).start()

    def _run(self, run) -> None:
        try:
            ended = run(self._ask, self._show)
        except Exception as exc:  # noqa: BLE001 - said to the notebook
            ended = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._ended = ended
            self._lock.notify_all()

    def _ask(self, prompt: str) -> str:
        with self._lock:
            self._prompt = prompt
            self._lock.notify_all()
        return self._answers.get()

    def _show(self, text: str) -> None:
        with self._lock:
            self._output.append(text)

    def step(self, answer: Optional[str], wait: float = ANSWER_SECONDS + 5) -> Dict[str, Any]:
        """Send ``answer`` (None: none, the first step); what pdb wrote since, and its next
        prompt (None once it ended: then ``ended`` says how)."""
        with self._lock:
            if answer is not None:
                self._prompt = None
                self._answers.put(answer)
            self._lock.wait_for(lambda: self._prompt is not None or self._ended is not None,
                                timeout=wait)
            output, self._output = "".join(self._output), []
            return {"output": output, "prompt": self._prompt, "ended": self._ended}
