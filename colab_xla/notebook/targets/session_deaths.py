"""How a session's replicas died: :class:`ReplicaDeaths`, the bookkeeping a
:class:`~colab_xla.notebook.targets.session.Session` owns, from which it says why it ended.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from ..endings import describe_exit, killed_while
from ...wire.job import failure_path

# Why a session ended when its launcher saw every replica process end, unless it knows more.
PROCESSES_ENDED = "its replica processes ended"


class ReplicaDeaths:
    """The replicas of one session whose own process died: each one's exit code and how
    it ended (the first time), and what it wrote as it failed outside its cell (read once
    from the session's ``directory``). ``ordinal(index)``: replica ``index``'s ordinal as
    the notebook counts it. Not locked itself: its session records and copies under its own
    lock, where the launcher's thread and a cell's meet."""

    def __init__(self, directory: str, ordinal: Callable[[int], int]):
        self._directory, self._ordinal = directory, ordinal
        self._codes: Dict[int, int] = {}  # replica -> exit code of its process
        self._notes: Dict[int, str] = {}  # replica -> how its process ended
        self._failures: Dict[int, List[str]] = {}  # replica -> its failure outside a cell

    def __bool__(self) -> bool:
        return bool(self._codes)

    def __contains__(self, index: int) -> bool:
        return index in self._codes

    def record(self, index: int, code: int, memory: Optional[str]) -> None:
        """Replica ``index``'s process ended with ``code`` (``memory``: the machine's memory
        then, as :func:`~colab_xla.notebook.endings.killed_while` says it); its first end
        is kept."""
        if index not in self._codes:
            self._codes[index] = code
            self._notes[index] = killed_while(code, memory)

    def codes(self) -> Dict[int, int]:
        """Replica -> the exit code of its process, for every one that died (a copy)."""
        return dict(self._codes)

    def code(self, index: int, default: int) -> int:
        """The exit code of replica ``index``'s process (``default``: it did not die)."""
        return self._codes.get(index, default)

    @property
    def reason(self) -> Optional[str]:
        """How the first replica that died went (None while none did)."""
        if not self._codes:
            return None
        index, code = sorted(self._codes.items())[0]
        how = self._notes.get(index) or describe_exit(code)
        reason = f"replica {self._ordinal(index)} died ({how})"
        failure = self.failure(index)
        if failure:
            reason += f"; it failed outside its cell: {failure[-1].strip()[:300]}"
        return reason

    def failure(self, index: int) -> List[str]:
        """What replica ``index`` wrote as it failed outside its cell (its traceback), read
        once (the session's directory goes with it)."""
        if index not in self._failures:
            try:
                with open(failure_path(self._directory, index)) as f:
                    self._failures[index] = [line for line in f.read().splitlines()
                                             if line.strip()]
            except OSError:
                return []
        return self._failures[index]

    def failures_said(self) -> str:
        """What every replica read so far wrote as it failed, as the end of a message."""
        return "".join(f"\nWhat replica {self._ordinal(index)} wrote as it failed:\n"
                       + "\n".join("  " + line for line in lines)
                       for index, lines in sorted(self._failures.items()) if lines)

    def exit_codes(self, processes) -> List[int]:
        """The non-zero exit codes of the session's processes that ended (``processes``:
        its :class:`~colab_xla.notebook.processes.RunProcesses`, which saw the others)."""
        return sorted({code for code in self._codes.values() if code}
                      | set(processes.exit_codes()))


def how_processes_ended(processes) -> str:
    """Why a session ended when its launcher (xmp.spawn's pool) saw its ``processes`` end
    without telling which replica's: how they ended, as their exit codes say."""
    codes = processes.exit_codes()
    if not codes:
        return PROCESSES_ENDED
    memory = processes.memory_note(None)
    return f"{PROCESSES_ENDED} ({', '.join(killed_while(c, memory) for c in codes)})"
