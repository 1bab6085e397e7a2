"""A session's command pipes: two named pipes per replica in the session's directory,
through which the notebook tells the replica what to do, a line per command. Between
cells, the replica's own thread reads its command pipe
(:func:`colab_xla.wire.job.command_path`): ``job BASE64`` or ``run PATH``
(a cell's job, pickled in the line, or in a file:
:func:`colab_xla.wire.job.job_to_command`), ``debug ANSWERS OUTPUT`` (``%xla_debug``),
``stop``; a thread of the replica reads its urgent pipe
(:func:`colab_xla.wire.job.urgent_path`) all the time: ``interrupt RUN_ID``, ``complete
PATH EXPR`` (:mod:`colab_xla.replica.serve`).
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, Tuple

from ...wire.job import URGENT_VERBS, command_path, urgent_path


class CommandPipes:
    """The command pipes of the session in ``directory``, by replica ordinal."""

    def __init__(self, directory: str):
        self.directory = directory
        # ordinal -> write fds of its command pipe and its urgent pipe
        self._fds: Dict[int, Tuple[int, int]] = {}

    def _paths(self, index: int) -> Tuple[str, str]:
        return command_path(self.directory, index), urgent_path(self.directory, index)

    def make(self, index: int) -> None:
        """Make replica ``index``'s pipes before it starts, and hold them open (for
        reading and writing: opening never blocks, and a command waits there for the
        replica)."""
        for path in self._paths(index):
            os.mkfifo(path, 0o600)
        self._fds[index] = tuple(os.open(path, os.O_RDWR) for path in self._paths(index))

    def open(self, index: int) -> None:
        """Open the pipes a replica made itself (one this process did not plan: see
        :func:`colab_xla.replica.serve.serve`), unless they are open."""
        if index not in self._fds:
            self._fds[index] = tuple(os.open(path, os.O_WRONLY)
                                     for path in self._paths(index))

    def send(self, command: str, ordinals: Iterable[int]) -> None:
        """``command`` to the replicas ``ordinals``, through the pipe its verb goes to;
        one whose process is gone is skipped (the launcher tells of it)."""
        line = command.encode() + b"\n"
        urgent = int(command.partition(" ")[0] in URGENT_VERBS)
        for index in ordinals:
            fds = self._fds.get(index)
            if fds is not None:
                try:
                    os.write(fds[urgent], line)
                except OSError:  # its process is gone: the launcher tells
                    pass

    def send_every(self, command: str) -> None:
        """``command`` through every replica's pipe, the replicas not yet ready included."""
        self.send(command, list(self._fds))

    def close(self) -> None:
        for fds in self._fds.values():
            for fd in fds:
                os.close(fd)
        self._fds.clear()
