"""The interface of a session (``%xla_session``): a :class:`SessionTarget`, the
:class:`~colab_xla.notebook.targets.target.Target` that keeps its replicas from cell to cell.

Two implement it: :class:`~colab_xla.notebook.targets.session.Session` (this machine's
replicas) and :class:`~colab_xla.notebook.targets.cluster_session.ClusterSession` (every
host's). The magics reach either through
:func:`colab_xla.notebook.targets.current_session` and use only what is here.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple, Union

from .known_names import KnownNames
from .target import Target


class SessionTarget(Target):
    """Warm replicas, as ``%xla_session`` and ``%xla_debug`` use them: besides a target's
    verbs, :attr:`up`, :attr:`ended` (why it ended, once it has), :meth:`debug` and
    :meth:`describe_start`; and what every session keeps of its cells: which notebook names
    its replicas have (:attr:`known`), when it started, how long its start took, how many
    cells it ran, which replicas failed in the last one."""

    def __init__(self) -> None:
        self.known = KnownNames()  # the notebook names the replicas have
        self.started_at = time.time()
        self.cells_run = 0
        self.start_seconds: Optional[float] = None  # how long its start took
        self.ended: Optional[str] = None  # why the session ended, once it has
        self.last_failed: List[int] = []  # the replicas that failed in the last cell

    @property
    def up(self) -> bool:
        """Whether the session can run a cell (it has not ended)."""
        return self.ended is None

    def debug(self, asked: Union[int, Tuple[int, int], None], ask: Callable[[str], str],
              show: Callable[[str], None]) -> str:
        """``%xla_debug``: pdb's post-mortem on replica ``asked``'s last exception (None:
        the lowest replica that failed in the last cell), its prompts asked with ``ask``,
        what it writes shown with ``show``; how it ended. The session goes on."""
        raise NotImplementedError

    def describe_start(self) -> str:
        """What ``%xla_session start`` says once the replicas are up."""
        raise NotImplementedError
