"""A session's command pipes: one named pipe per replica in the session's directory
(:func:`colab_xla.wire.job.command_path`), through which the notebook tells the replica
what to do, a line per command, read by a thread of the replica
(:mod:`colab_xla.replica.serve`): ``job BASE64`` or ``run PATH`` (a cell's pickled job,
in the line or in a file: :func:`colab_xla.wire.job.job_command`), ``interrupt RUN_ID``,
``debug ANSWERS OUTPUT`` (``%xla_debug``), ``stop``.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable

from ...wire.job import command_path


class CommandPipes:
    """The command pipes of the session in ``directory``, by replica ordinal."""

    def __init__(self, directory: str):
        self.directory = directory
        self._fds: Dict[int, int] = {}  # ordinal -> write fd of its command pipe

    def make(self, index: int) -> None:
        """Make replica ``index``'s pipe before it starts, and hold it open (for reading
        and writing: opening never blocks, and a command waits there for the replica)."""
        path = command_path(self.directory, index)
        os.mkfifo(path, 0o600)
        self._fds[index] = os.open(path, os.O_RDWR)

    def open(self, index: int) -> None:
        """Open the pipe a replica made itself (one this process did not plan: see
        :func:`colab_xla.replica.serve.serve`), unless it is open."""
        if index not in self._fds:
            self._fds[index] = os.open(command_path(self.directory, index), os.O_WRONLY)

    def send(self, command: str, ordinals: Iterable[int]) -> None:
        """``command`` to the replicas ``ordinals``; one whose process is gone is skipped
        (the launcher tells of it)."""
        line = command.encode() + b"\n"
        for index in ordinals:
            fd = self._fds.get(index)
            if fd is not None:
                try:
                    os.write(fd, line)
                except OSError:  # its process is gone: the launcher tells
                    pass

    def send_every(self, command: str) -> None:
        """``command`` through every pipe, the replicas not yet ready included."""
        self.send(command, list(self._fds))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
