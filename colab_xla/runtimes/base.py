"""What every runtime is: the :class:`Runtime` interface, and :data:`VARIABLE`, the
environment variable that names the runtime of a replica.

A runtime answers every question whose answer depends on it, so that nothing else compares
runtime names: the notebook's half in the notebook's process (and in a cluster host's
agent), the replica's half in each replica process, where it imports its own packages
(torch_xla, jax) when it is called, never before. The registry of runtimes is
:mod:`colab_xla.runtimes`; this module is a leaf of it (the runtimes import it).
"""

from __future__ import annotations

import abc
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Pattern,
                    Sequence, Tuple)

from ..errors import OptionError

if TYPE_CHECKING:
    from ..errors import Problem
    from .plan import Hardware, ReplicaPlan

# The variable a plan sets for the replicas of a runtime other than the default, and that
# the replicas (and the launcher) read to know their runtime (colab_xla.runtimes.current).
VARIABLE = "COLAB_XLA_RUNTIME"


def refuse_xmp_launch(launch, runtime: str, starts: str) -> None:
    """For a runtime that starts its processes itself (``starts``: what it calls them):
    refuse torch_xla's launch options, ``--launcher`` and ``--debug-single``."""
    if launch.launcher != "xmp" or launch.debug_single:
        raise OptionError(f"--runtime {runtime} starts {starts} itself: --launcher and "
                          "--debug-single are torch_xla's.")


class Runtime(abc.ABC):
    """One runtime: how its replicas are planned, launched and set up, and how their
    values come back. One instance per runtime (the registry's); runtimes compare equal
    by kind, so a copy is the same runtime."""

    name: str  # what --runtime takes
    # What Launch.describe() adds after the start method ("JAX processes (jax.distributed)").
    described_as: Optional[str] = None
    # What its replicas are, where a cluster session counts them ("JAX processes").
    replicas_are: Optional[str] = None
    # The Problem code of "this runtime has started in the notebook's own process", and
    # the calls that start it (the cell that likely did it is named in the refusal).
    started_code: str
    starting_calls: Pattern[str]
    # What the notebook's process imports before the replicas start, so that forked
    # replicas find it imported rather than each importing it (seconds for torch): module
    # names (colab_xla.notebook.torch_xla_import.preload: the environment left alone).
    # Importing them never starts the runtime. By default, torch_xla's launcher.
    preloads: Tuple[str, ...] = ("torch_xla.distributed.xla_multiprocessing",)
    # What each replica of a CPU simulation imports besides, preloaded too when the plan
    # is one. Only a speed-up: one that fails to import is skipped, and its replicas say
    # why when they import it.
    simulation_preloads: Tuple[str, ...] = ()
    # The modules whose functions its replica half replaces (under every name bound to
    # them: colab_xla.runtimes.bound_names); the notebook's process finds those names
    # before it forks, so that each forked replica need not read every module.
    replaces: Tuple[str, ...] = ()
    # -- the notebook's half ----------------------------------------------------------

    @abc.abstractmethod
    def check_installed(self) -> None:
        """Refuse (:class:`colab_xla.errors.SetupError`, with how to install it) where this
        runtime is not installed."""

    @abc.abstractmethod
    def check_launch(self, launch) -> None:
        """Refuse (:class:`colab_xla.errors.OptionError`) the options of ``launch`` (a
        :class:`colab_xla.notebook.launch.Launch`) that are not this runtime's."""

    @abc.abstractmethod
    def plan(self, requested: Optional[int], hardware: "Hardware", *,
             simulate: Optional[str] = None, devices_per_process: Optional[int] = None,
             environ: Optional[Mapping[str, str]] = None) -> "ReplicaPlan":
        """The replicas of a run on one host: ``requested`` (``-n``, None: the default),
        on ``hardware``, with ``environ`` the replicas' environment; or
        :class:`colab_xla.runtimes.plan.ReplicaCountError` saying why not."""

    @abc.abstractmethod
    def own_processes(self, plan: "ReplicaPlan") -> bool:
        """Whether colab_xla starts ``plan``'s processes itself (one replica each) rather
        than the runtime's own launcher."""

    @abc.abstractmethod
    def problems(self) -> List["Problem"]:
        """What this runtime refuses in the notebook's process before its replicas start
        (each a fatal :class:`colab_xla.errors.Problem` whose code is
        :attr:`started_code`)."""

    @abc.abstractmethod
    def run_environ(self, environ: Mapping[str, str], free_port: Callable[[], int],
                    unix_socket: Optional[Callable[[str], Optional[str]]] = None
                    ) -> Dict[str, str]:
        """The variables the launcher adds for one run, of processes it starts itself or
        of the runtime's own launcher, the replicas' environment being ``environ`` (with
        what the launcher gives every process it starts: ``PJRT_LOCAL_PROCESS_COUNT`` and
        :func:`meeting_place`'s;
        ``free_port()``: a port of this machine's free now; ``unix_socket(name)``: a path
        for a Unix socket of the run in its private directory, None where it would be too
        long for one)."""

    @abc.abstractmethod
    def cluster_replicas(self, host: Mapping[str, Any]) -> Optional[int]:
        """The replicas a cluster's host runs (``host``: its agent's description, with
        "device" and the "replicas" %xla_cluster planned)."""

    @abc.abstractmethod
    def check_cluster(self, hosts: Sequence[Mapping[str, Any]], launch) -> None:
        """Refuse, before anything starts on a cluster, an option of ``launch`` that
        ``hosts`` (their agents' descriptions) cannot honour."""

    @abc.abstractmethod
    def cluster_environ(self, hosts: Sequence[Mapping[str, Any]],
                        coordinator: Callable[[], str]) -> Dict[str, str]:
        """The variables every host's replicas get for one run (or session) on a cluster
        of ``hosts`` (their agents' descriptions, host 0 first); ``coordinator()`` asks
        host 0's agent for an address of its own and a free port."""

    def doctor_facts(self, hardware: "Hardware", environ: Mapping[str, str],
                     version: Callable[[str], Optional[str]]) -> List[Tuple[str, str]]:
        """What ``%xla_doctor`` lists of this runtime here (``(label, text)`` lines; none
        by default): its packages (``version(name)``: the doctor's, None if not
        installed), its processes and devices, whether this notebook's process holds
        them. Never starts the runtime."""
        return []

    # -- the replica's half (called in a replica process) ----------------------------

    @abc.abstractmethod
    def start_process(self, process, job) -> None:
        """Set up a new replica process (``process``: its
        :class:`colab_xla.replica.process.ReplicaProcess`; ``job``: the first run's
        :class:`colab_xla.wire.job.ReplicaJob`), once, before any cell."""

    @abc.abstractmethod
    def device(self) -> Any:
        """The cell's ``device`` (asked on first use, in the replica's thread)."""

    @abc.abstractmethod
    def before_cell(self) -> None:
        """In the replica's thread, before each cell runs (interruptible as the cell)."""

    @abc.abstractmethod
    def after_process(self) -> None:
        """In a process colab_xla started itself, after its replica ended."""

    @abc.abstractmethod
    def to_host(self, value: Any) -> Any:
        """``value`` as the notebook can load it (``-o``, ``--pull``)."""

    # -- as a value -------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<runtime {self.name}>"


def meeting_place(environ: Mapping[str, str], free_port: Callable[[], int]) -> Dict[str, str]:
    """Where torch.distributed's ``xla://`` and ``env://`` meet, MASTER_ADDR:MASTER_PORT,
    as far as ``environ`` (the replicas') names neither: this machine, and a port of the
    run's own (``free_port()``), so that two notebooks (or two runs) train side by side
    rather than meet at torch_xla's default port."""
    place = {"MASTER_ADDR": lambda: "127.0.0.1", "MASTER_PORT": lambda: str(free_port())}
    return {key: value() for key, value in place.items() if key not in environ}
