"""Why a replica ended without its report, told as data: a :class:`ReplicaError` whose
message says what happened and what to do.

A run stopped by an Interrupt, its ``--timeout``, the fail-fast rule or a replica that did
not start the cell in time settles the replicas still running as *stopped*
(:func:`stopped`), with where each one was (its last output line, its last
``xm.rendezvous``). A replica whose process ended under it *died*
(:func:`died`): the message names the cause it can find (``os._exit`` from a replica, the
exit code or signal, XLA's own fatal line from the process output). A launch that started
no replica at all is :func:`launch_error`.
"""

from __future__ import annotations

import contextlib
import re
import signal
import traceback
from typing import Iterable, Mapping, Optional, Sequence, Tuple

from ..wire.reports import ReplicaError
from .outcome import ReplicaOutcome, format_ordinals


def stopped(reason: str, rep: ReplicaOutcome, *, timeout: Optional[float] = None,
            first_failed: Optional[ReplicaOutcome] = None, grace: float = 0.0,
            unstarted: Sequence[int] = (), start: Optional[float] = None) -> ReplicaError:
    """Replica ``rep``, still running when the run was stopped for ``reason``:
    "interrupted", "timeout" (after ``timeout`` s), "failed" (``grace`` s after
    ``first_failed`` failed) or "unstarted" (the replicas ``unstarted`` had not started the
    cell ``start`` s after it was sent)."""
    where = whereabouts(rep)
    if reason == "unstarted":
        if rep.ordinal in unstarted:
            return ReplicaError("unstarted", "NotStarted",
                                f"did not start the cell within {start:g} s of it being sent "
                                "(its process was alive), so the run was stopped; run the "
                                "cell again, and if it happens again, %xla_doctor says what "
                                "else holds this machine", where=where)
        which = format_ordinals(unstarted)
        return ReplicaError("stopped", "Stopped",
                            f"stopped: replica{'s' if len(unstarted) > 1 else ''} {which} "
                            f"did not start the cell within {start:g} s", where=where)
    if reason == "interrupted":
        return ReplicaError("interrupted", "KeyboardInterrupt", "interrupted while running",
                            where=where)
    if reason == "timeout":
        return ReplicaError("timeout", "Timeout", f"still running after --timeout {timeout:g} s, "
                            "so the run was stopped", where=where)
    if reason == "failed":
        return ReplicaError("stopped", "Stopped",
                            f"stopped {grace:g} s after replica {first_failed.ordinal} failed "
                            f"({first_failed.error.ename})", where=where)
    raise ValueError(f"no such reason to stop a run: {reason!r}")


def died(rep: ReplicaOutcome, *, exits: Mapping[int, Tuple[int, int]], exit_codes: Sequence[int],
         process_logs: Iterable, one_process: bool,
         driver_error: Optional[BaseException] = None,
         memory: Optional[str] = None) -> ReplicaError:
    """Replica ``rep``, whose process ended before it reported. ``exits``: pid ->
    (replica, code) of the ``os._exit`` calls replicas reported; ``exit_codes``: the
    non-zero exit codes of the run's processes; ``process_logs``: the output logs of the
    processes (not of one replica); ``one_process``: the run had a single replica
    process; ``driver_error``: what the launcher raised, if anything; ``memory``: that
    memory was high just before (said of a SIGKILL)."""
    return ReplicaError("died", "ReplicaDied",
                        _death_reason(rep, exits, exit_codes, process_logs, one_process,
                                      driver_error, memory))


def killed_while(code: int, memory: Optional[str]) -> str:
    """How a process ended (:func:`describe_exit`), and for a SIGKILL while memory was
    high, that (``memory``: :meth:`colab_xla.notebook.processes.RunProcesses.memory_note`)."""
    said = describe_exit(code)
    if memory and code == -signal.SIGKILL:
        said += f" while {memory}"
    return said


def _death_reason(rep, exits, exit_codes, process_logs, one_process, driver_error,
                  memory=None) -> str:
    pid = rep.pid
    if pid is None and one_process and exits:
        pid = next(iter(exits))  # it never started: its process is the one
    if pid in exits:
        ordinal, code = exits[pid]
        same = "" if ordinal == rep.ordinal else (
            f" (replica {rep.ordinal} ran as a thread of that process, so it ended too)")
        return (f"replica {ordinal} called os._exit({code}), which ended its process "
                f"(exit code {code}) before the cell finished{same}. Let the cell end "
                "instead (or sys.exit(), which ends only that replica).")
    how = ", ".join(killed_while(c, memory) for c in exit_codes)
    said = native_crash([rep.log, *process_logs])
    if said is not None:
        signal_name, message = said
        how = how or (f"killed by {signal_name}" if signal_name else "")
        if message:
            return (f"the replica's process ended before the cell finished: "
                    f"{how or 'a native crash'}; XLA said: {message!r}. Fix what it names "
                    "(a flag in XLA_FLAGS or --env, say) and run the cell again; the "
                    "process output has the rest (and the stack of every thread).")
    cause = f" ({type(driver_error).__name__}: {driver_error})" if driver_error else ""
    return (f"the replica's process ended before the cell finished: "
            f"{how or 'without an exit code'}{cause}. Its last output is above; a crash "
            "in native code (SIGSEGV, SIGABRT) usually leaves XLA's own message in the "
            "process output or the full logs.")


# An absl/glog fatal line, as XLA and libtpu write it before they abort:
# "2026-11-23 10:16:28.249609: F external/xla/...cc:234] Unknown flag in XLA_FLAGS: --x"
# or "F1123 10:16:28.249609  1234 file.cc:234] Check failed: ...".
_FATAL_LINE = re.compile(r"(?:^|: )F(?:\d{4} [\d:.]+\s+\d+)?\s+[\w./-]+:\d+\]\s+(?P<message>.+)$")
# Python's faulthandler names the signal (enabled in every replica process).
_FAULTHANDLER = {"Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS",
                 "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}


def native_crash(logs) -> Optional[Tuple[Optional[str], Optional[str]]]:
    """``(signal name, XLA's fatal message)`` found in the output of a process that
    crashed in native code, or None: from the first fatal line and the faulthandler
    header ("Fatal Python error: Aborted")."""
    signal_name = message = None
    for log in logs:
        for _, line in log.tail:
            if message is None:
                found = _FATAL_LINE.search(line)
                if found:
                    message = found.group("message")[:300]
            if signal_name is None and line.startswith("Fatal Python error: "):
                signal_name = _FAULTHANDLER.get(line[len("Fatal Python error: "):].strip())
    return (signal_name, message) if signal_name or message else None


def launch_error(exc: BaseException, *, session: bool = False) -> ReplicaError:
    """The run never started, its exception as data: kind ``"launch"``, the launcher
    failed before any replica said a word (xmp.spawn, the runtime's set-up of the run's
    processes); with ``session``, kind ``"unsent"``, the cell could not be sent to a
    session's replicas, which are still up and waiting for the next cell."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ReplicaError("unsent" if session else "launch", type(exc).__name__,
                        str(exc) or repr(exc), text)


def whereabouts(rep) -> str:
    """Where a replica was when the run was cut: its last line, its last rendezvous."""
    lines = rep.log.tail_text().rsplit("\n", 1)
    parts = []
    if lines[-1]:
        parts.append(f"last output: {lines[-1][:200]!r}")
    if rep.last_rendezvous is not None:
        parts.append(f"last xm.rendezvous: {rep.last_rendezvous!r}")
    return "; ".join(parts) if parts else "no output yet"


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
