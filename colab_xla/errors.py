"""The refusals before a run starts: :class:`SetupError` and its kinds.

Everything that stops a run before any replica starts (an empty cell, a bad option, a
replica count the hardware cannot run, torch_xla missing, SPMD on, a TPU held by another
process, an unsafe state directory, names that cannot be sent to a replica) is a
:class:`SetupError` whose message says what to do. The magic shows exactly these as
usage errors, without a traceback; any other exception is a bug and keeps its traceback.
What goes wrong once replicas run is not raised: it is data in the outcome
(:mod:`colab_xla.notebook.outcome`).
"""

from dataclasses import dataclass


class SetupError(Exception):
    """A run refused before it started; ``str()`` says why and what to do."""


class OptionError(SetupError, ValueError):
    """A bad option value (``--timeout 0``, ``--env 1X=y``, ``--pull not-a-name``)."""


@dataclass(frozen=True)
class Problem:
    """Something found before a run starts that would fail or surprise, with its fix
    (``fatal``: the run is refused)."""

    code: str
    message: str  # what is wrong
    fix: str  # what to do
    fatal: bool = True  # refuse to start (else: handled, and said in one line)

    def render(self) -> str:
        return f"{self.message}\nFix: {self.fix}"


class PreflightError(SetupError):
    """A fatal problem found before starting replicas (the message says what to do)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(problem.render())


class RuntimeInitializedError(PreflightError):
    """The notebook's process already initialized XLA (or, for the JAX runtime, a JAX
    backend); replicas cannot start."""
