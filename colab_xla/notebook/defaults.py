"""The defaults a person sets in the environment (``COLAB_XLA_*``), read in one place, once
per request (a cell, a session's start), so that what a line leaves out means the same
everywhere it is used.

============================  ================================================================
``COLAB_XLA_START_METHOD``    ``%%xla_spawn``'s and ``%xla_session start``'s ``--start-method``
                              (default ``fork``; ``forkserver`` also starts the server at
                              ``%load_ext colab_xla``)
``COLAB_XLA_SIMULATE``        ``--simulate`` on CPU (default ``processes``)
``COLAB_XLA_VIEW``            ``text``: text lines instead of the widget, as ``--no-widget``
``COLAB_XLA_TPU_HOLDERS``     ``warn``: a TPU held by another process is a note, not a refusal
============================  ================================================================

Example::

    >>> Defaults.read({"COLAB_XLA_SIMULATE": "threads", "COLAB_XLA_VIEW": "Text"})
    Defaults(start_method='fork', simulate='threads', view='text', tpu_holders=None)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from ..runtimes.simulation import DEFAULT_SIMULATION

START_METHOD = "COLAB_XLA_START_METHOD"
SIMULATE = "COLAB_XLA_SIMULATE"
VIEW = "COLAB_XLA_VIEW"
TPU_HOLDERS = "COLAB_XLA_TPU_HOLDERS"


@dataclass(frozen=True)
class Defaults:
    """What a run uses for what it was not given. Values are as set (checked where they
    are used, so that a bad one is refused with the option's message)."""

    start_method: str = "fork"
    simulate: str = DEFAULT_SIMULATION
    view: str = "auto"  # "text", or "auto": the widget where it can show
    tpu_holders: Optional[str] = None  # "warn": a held TPU is a note

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> "Defaults":
        return cls(start_method=environ.get(START_METHOD, "fork"),
                   simulate=environ.get(SIMULATE) or DEFAULT_SIMULATION,
                   view=environ.get(VIEW, "auto").lower(),
                   tpu_holders=environ.get(TPU_HOLDERS))

    def refuses_tpu_holders(self, env: Mapping[str, str]) -> bool:
        """Whether a TPU held by another process refuses the run (else it is a note).
        ``env`` is the run's ``--env``: the replicas' environment is where the setting is
        looked up, so ``--env COLAB_XLA_TPU_HOLDERS=warn`` counts too."""
        return env.get(TPU_HOLDERS, self.tpu_holders) != "warn"
