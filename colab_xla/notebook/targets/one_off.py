"""Run a cell on every XLA replica: the notebook side, IPython-free.

:func:`run_cell` checks the options, writes the cell to a module, plans the replicas for
the hardware (:mod:`colab_xla.notebook.hardware`) with the run's runtime
(:mod:`colab_xla.runtimes`), refuses what cannot work before anything starts
(:mod:`colab_xla.notebook.preflight`), says what a person should know (once per notebook process),
and hands the run to a :class:`colab_xla.notebook.supervisor.Supervisor`, which starts the replicas
and reads them in the calling thread until they end: the caller (the kernel's main thread)
stays interruptible. The notebook's process never initializes the XLA runtime and never
runs a replica.

That is a *one-off run*, the target :class:`OneOff`: replicas started for the cell on this
machine and ended after it (``%%xla_spawn`` with no session up, or ``--fresh``);
:func:`run_cell` makes the request from its keywords and runs it on one, or on the session
it is given. A session's start is planned, checked and announced the same way
(:func:`colab_xla.notebook.targets.session.new_session`).

Example (in a plain Python process with torch_xla installed)::

    >>> outcome = run_cell("print('hi from', index)\\nindex * 10", replicas=2)
    >>> outcome.results()
    {0: 0, 1: 10}
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Mapping, Optional, Sequence, Tuple

from .. import chosen, hardware, interrupts, options, preflight, processes, state, torch_xla_import
from ...wire.cell import Cell, CellModule
from ..defaults import Defaults
from ..launch import Launch, replica_environ, wait_forkserver, warm_forkserver
from ..outcome import RunObserver, RunOutcome
from ..request import DEFAULT_STALL_SECONDS, CellRequest, LaunchAsked
from ..supervisor import RunRequest, Supervisor
from ...wire import names
from .target import Target
from ...runtimes.plan import ReplicaPlan


def run_cell(source: str, *, replicas: Optional[int] = None, user_ns: Optional[Mapping] = None,
             label: str = "cell", header: str = "# %%xla_spawn",
             observer: Optional[RunObserver] = None, announce=print,
             timeout: Optional[float] = None, launch: Optional[Launch] = None,
             env: Optional[Mapping[str, str]] = None, cache_dir: Optional[str] = None,
             pull: Sequence[str] = (), pull_from: Optional[int] = None,
             simulate: Optional[str] = None, session: Optional[Target] = None,
             hosted: Optional[interrupts.Remote] = None,
             stall: Optional[float] = DEFAULT_STALL_SECONDS,
             targets: Optional[str] = None) -> RunOutcome:
    """Run ``source`` on every replica and return the :class:`RunOutcome`.

    ``launch`` says how replicas start (start method, launcher, one-replica debugging;
    default: fork through xmp.spawn);
    ``env`` adds variables for the replicas only (the replica count and device are
    planned with them); ``cache_dir`` turns on torch_xla's persistent compilation cache,
    a sub-directory per replica process; ``simulate`` is how replicas on CPU simulate a TPU
    host (:mod:`colab_xla.runtimes.cpu_sim`: "processes", the default, or "threads"; default
    ``$COLAB_XLA_SIMULATE``); ``pull`` names are sent back from every replica
    (or only from replica ``pull_from``) into ``outcome.pulled(name)``.

    With ``session`` (a :class:`~.session.Session` that is up), the cell runs on
    the session's replicas, in the globals each keeps from cell to cell; ``replicas``,
    ``env``, ``cache_dir``, ``simulate`` and ``launch`` are the session's and cannot be
    given. A session that ends during the cell says why in ``outcome.session_ended``.
    ``targets`` (``"0,2"``, ``"0-3"``: ``--targets``) runs it on those of the session's
    replicas only; a one-off run refuses it.

    ``stall``: when no replica has printed for that many seconds, ``observer.stalled``
    is told where each replica is (again while it lasts; None or 0: never).

    ``hosted`` makes this a run a cluster's host agent runs for the notebook
    (:mod:`colab_xla.notebook.cluster`): values stay packed for the notebook to load, and the
    agent interrupts the run through it.

    The run ends when every replica has ended; or
    :data:`colab_xla.notebook.deadlines.FAIL_FAST_SECONDS` after the first replica failed; or after
    ``timeout`` seconds; or on Interrupt (SIGINT). Then every process it started is killed,
    and replicas still running are *stopped*, with the reason, their last output line and
    their last ``xm.rendezvous`` tag.

    Raises before anything starts, with a message that says what to do: a
    :class:`colab_xla.errors.SetupError` (an empty cell, a bad option, a replica count the
    hardware cannot run, torch_xla missing, SPMD on, a cell that spawns replicas itself,
    the TPU held by another process, XLA already started in this process, names that
    cannot be sent to a replica that does not fork), or ``SyntaxError`` with the cell's
    line. Failures of replicas are not raised: they are in the outcome (see
    ``outcome.failed``).
    """
    request = CellRequest(
        Cell(source, label=label, header=header), user_ns=user_ns or {}, replicas=replicas,
        launch=LaunchAsked.of(launch), env=dict(env or {}), cache_dir=cache_dir,
        simulate=simulate, timeout=timeout, pull=tuple(pull), pull_from=pull_from,
        announce=announce, hosted=hosted, stall=stall,
        targets=None if targets is None else chosen.parse(targets),
        # Fork unless ``launch`` says otherwise: $COLAB_XLA_START_METHOD is the magics'.
        defaults=dataclasses.replace(Defaults.read(), start_method="fork"))
    target = session if session is not None else OneOff()
    return target.run(request, observer)


class OneOff(Target):
    """A one-off run on this machine: every option a request gives applies."""

    def run(self, request: CellRequest,
            observer: Optional[RunObserver] = None) -> RunOutcome:
        """Run the cell on replicas of its own (see
        :func:`colab_xla.notebook.targets.run_cell`, which says what each option does)."""
        self.refuse(request)
        cell, defaults = request.cell, request.defaults
        env, launch = dict(request.env), request.launch.one_off()
        simulate = request.simulate or defaults.simulate
        cache_dir = options.check_run(replicas=request.replicas, timeout=request.timeout,
                                      env=env, pull=request.pull, pull_from=request.pull_from,
                                      cache_dir=request.cache_dir, launch=launch,
                                      simulate=simulate)
        user_ns = dict(request.user_ns)
        run_dir = state.new_work_dir("run-")
        try:
            module = CellModule.create(cell, run_dir)
            plan, notes = planned(cell, replicas=request.replicas, launch=launch, env=env,
                                  simulate=simulate, pull_from=request.pull_from,
                                  defaults=defaults)
            sent_names = None
            if launch.start_method != "fork":
                sent_names = names.pack(names.used_names(cell, user_ns), user_ns,
                                        launch.start_method)
            parent_pid = say_notes(plan, launch, notes, request.announce)
            run = RunRequest(launch, parent_pid, module, sent_names, cache_dir, request.pull,
                             request.pull_from, request.hosted, began=request.began)
            return Supervisor(run, plan, run_dir, user_ns, observer or RunObserver(),
                              request.timeout, stall=request.stall).run()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def describe(self) -> str:
        return "colab_xla: a one-off run on this machine (replicas of the cell's own)."


def planned(cell: Optional[Cell], *, replicas, launch: Launch, env, simulate,
            pull_from, defaults: Defaults) -> Tuple[ReplicaPlan, list]:
    """The plan for ``cell`` (device, replica count, processes, and every variable the
    replicas get, ``env`` included), with what would fail refused: the plan, and the
    problems to note. (None: a session's, before its first cell.)"""
    replica_env = replica_environ(env)  # what the replicas will see, --env included
    runtime = launch.runtime
    runtime.check_installed()
    hw = hardware.detect(replica_env)
    plan = runtime.plan(replicas, hw, simulate=simulate,
                        devices_per_process=launch.devices_per_process, environ=replica_env)
    if launch.debug_single:  # one replica, one process, whatever the host has
        if plan.device_type == "CPU":
            plan = runtime.plan(1, hw, simulate=simulate, environ=replica_env)
        plan = dataclasses.replace(plan, replicas=1, processes=1)
    options.check_pull_from(pull_from, plan.replicas)
    torch_xla_import.preload(runtime.preloads)
    if plan.simulation:
        torch_xla_import.preload(runtime.simulation_preloads, required=False)
    problems = preflight.check(cell, replica_env, launch, plan.device_type,
                               defaults.refuses_tpu_holders(env))
    for problem in problems["fatal"]:
        raise preflight.refusal(problem)
    changes = {**env, **plan.env, **preflight.topology_changes(replica_env, plan.env)}
    return dataclasses.replace(plan, env=changes), problems["notes"]


def say_notes(plan: ReplicaPlan, launch: Launch, problems, announce) -> int:
    """Say what a person should know before the replicas start (once per notebook
    process; leftover processes on every run), warming the forkserver if it is used and
    then waiting for its imports (:func:`colab_xla.notebook.launch.wait_forkserver`).
    Return the replica processes' parent pid: this process's, or the forkserver's."""
    notes = [said_once(plan.note), said_once(_start_note(launch))]
    parent_pid = os.getpid()  # of the replica processes (each checks it)
    if launch.start_method == "forkserver":
        parent_pid, started = warm_forkserver()
        if started:
            notes.append(FORKSERVER_STARTING)
    notes += [said_once(f"colab_xla: {p.message} {p.fix}") for p in problems]
    leftovers = preflight.leftovers_problem(processes.leftovers())
    if leftovers:  # said on every run until they are gone
        notes.append(f"colab_xla: {leftovers.message} {leftovers.fix}")
    for note in filter(None, notes):
        if announce:
            announce(note)
    if launch.start_method == "forkserver":
        wait_forkserver()  # (before the run: an Interrupt now starts nothing)
    return parent_pid


def _start_note(launch: Launch) -> Optional[str]:
    if launch.debug_single:
        return ("colab_xla: --debug-single runs one replica (index 0) in a process of its "
                "own, through torch_xla.launch(debug_single_process=True).")
    if launch.start_method == "spawn":
        return ("colab_xla: --start-method spawn starts fresh interpreters, which import "
                "torch and torch_xla on every run (seconds); --start-method forkserver "
                "imports them once and then starts replicas about as fast as fork.")
    return None


FORKSERVER_STARTING = ("colab_xla: starting the forkserver: it imports torch and torch_xla "
                       "once (a few seconds; this run waits for it), then replicas fork from "
                       "it warm.")


def said_once(note: Optional[str]) -> Optional[str]:
    """``note`` the first time this notebook process sees it, else None."""
    if note is None or note in _said:
        return None
    _said.add(note)
    return note


_said: set = set()  # notes said once per notebook process
