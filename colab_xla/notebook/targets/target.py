"""The one interface of every place a cell runs: a :class:`Target`.

A target runs a :class:`~colab_xla.notebook.request.CellRequest` with an observer (a
view) and returns the :class:`~colab_xla.notebook.outcome.RunOutcome`; says which options
are its own and refuses a request that asks another value of them, with the way out;
describes itself (``%xla_session``, ``%xla_cluster``) and stops. The targets:

* :class:`~colab_xla.notebook.targets.one_off.OneOff`: replicas started for the cell on
  this machine, ended after it;
* :class:`~colab_xla.notebook.targets.session.Session`: this machine's warm replicas;
* :class:`~colab_xla.notebook.targets.cluster_one_off.ClusterOneOff`: every host of the
  connected cluster, each on replicas started for the cell;
* :class:`~colab_xla.notebook.targets.cluster_session.ClusterSession`: every host's warm
  replicas.

Which one a cell runs on is decided in one place: :func:`colab_xla.notebook.targets.current`.
"""

from __future__ import annotations

from typing import Optional, Tuple

from ...errors import OptionError
from ..outcome import RunObserver, RunOutcome
from ..request import CellRequest

# The options that choose a cell's replicas (as the line names them), in the order a
# refusal lists them.
REPLICA_OPTIONS = ("-n", "--start-method", "--launcher", "--debug-single", "--runtime",
                   "--devices-per-process", "--env", "--cache", "--simulate")


class Target:
    """Where a cell runs. ``own_options`` are the options whose values are the target's
    (a cell may repeat them, not change them); the others a request gives apply."""

    own_options: Tuple[str, ...] = ()
    keeps_replicas = False  # a session's: some of them may run a cell (--targets)

    def refuse(self, request: CellRequest) -> None:
        """Raise a :class:`~colab_xla.errors.SetupError` if ``request`` asks what this target
        cannot give (another value of one of its own options); its message says the way
        out. :meth:`run` refuses the same, so a caller may ask first (before it shows
        anything) or not."""
        if request.targets is not None and not self.keeps_replicas:
            raise OptionError(
                f"--targets {request.targets.text}: a one-off run starts its replicas for "
                "the cell, so every one runs it. --targets chooses among a session's "
                "replicas, which keep their state: %xla_session start first, or drop "
                "--targets.")

    def run(self, request: CellRequest,
            observer: Optional[RunObserver] = None) -> RunOutcome:
        """Run the cell on this target's replicas and return the outcome; refuse before
        anything starts (a :class:`~colab_xla.errors.SetupError`, or the cell's
        ``SyntaxError``); what goes wrong once replicas run is in the outcome."""
        raise NotImplementedError

    def describe(self) -> str:
        """What this target is, now (its status)."""
        raise NotImplementedError

    def stop(self) -> None:
        """End what the target keeps between cells (nothing, for a one-off run)."""
