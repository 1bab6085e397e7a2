"""The one interface of every place a cell runs: a :class:`Target`.

A target runs a :class:`~colab_xla.notebook.request.CellRequest` with an observer (a
view) and returns the :class:`~colab_xla.notebook.outcome.RunOutcome`; declares which
options are its own (:attr:`Target.own_options`, each :class:`Owned` group with its way
out), which :meth:`Target.refuse` reads against what the request asks; describes itself
(``%xla_session``, ``%xla_cluster``) and stops. The targets:

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

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Type

from ...errors import OptionError, SetupError
from ..outcome import RunObserver, RunOutcome
from ..request import CellRequest

# The options that choose a cell's replicas (as the line names them), in the order a
# refusal lists them.
REPLICA_OPTIONS = ("-n", "--start-method", "--launcher", "--debug-single", "--runtime",
                   "--devices-per-process", "--env", "--cache", "--simulate")


@dataclass(frozen=True)
class Owned:
    """Options whose values are a target's own, as the line names them, and the refusal of
    a request that asks another value of them: ``refusal`` is its message, ``{asked}`` the
    options asked (in the request's order), ``{own}`` the target's values
    (:meth:`Target.describe_own`); ``error`` its class.

    Example::

        >>> Owned(("-n",), "{asked}: the hosts' own; give -n to %xla_cluster.").among(
        ...     ["-n", "--timeout"])
        ['-n']
    """

    options: Tuple[str, ...]
    refusal: str
    error: Type[SetupError] = OptionError

    def among(self, asked: Sequence[str]) -> List[str]:
        """The options of ``asked`` that are these."""
        return [flag for flag in asked if flag in self.options]


class Target:
    """Where a cell runs. ``own_options`` declares the options whose values are the
    target's (a cell may repeat them, :meth:`repeats`, not change them), in groups that
    each say their way out; the others a request gives apply."""

    own_options: Tuple[Owned, ...] = ()
    keeps_replicas = False  # a session's: some of them may run a cell (--targets)

    def refuse(self, request: CellRequest) -> None:
        """Raise a :class:`~colab_xla.errors.SetupError` if ``request`` asks what this target
        cannot give (``--targets`` of one that keeps no replicas; another value of one of
        its :attr:`own_options`, the first group's that it asks); its message says the way
        out. :meth:`run` refuses the same, so a caller may ask first (before it shows
        anything) or not."""
        if request.targets is not None and not self.keeps_replicas:
            raise OptionError(
                f"--targets {request.targets.text}: a one-off run starts its replicas for "
                "the cell, so every one runs it. --targets chooses among a session's "
                "replicas, which keep their state: %xla_session start first, or drop "
                "--targets.")
        asked = request.replica_flags_asked()
        for owned in self.own_options:
            changed = [flag for flag in owned.among(asked) if not self.repeats(flag, request)]
            if changed:
                raise owned.error(owned.refusal.format(asked=", ".join(changed),
                                                       own=self.describe_own()))

    def repeats(self, flag: str, request: CellRequest) -> bool:
        """Whether ``request`` gives ``flag`` (one of :attr:`own_options`) the value that is
        the target's already (a cell may repeat it); none, unless a target says."""
        return False

    def describe_own(self) -> str:
        """The values of the target's own options, as a line would give them (a refusal
        says them)."""
        return ""

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
