"""Run a cell on every XLA replica: the notebook side, IPython-free.

:func:`run_cell` checks the options, writes the cell to a module, plans the replicas for
the hardware (:mod:`colab_xla.notebook.hardware`), refuses what cannot work before anything starts
(:mod:`colab_xla.notebook.preflight`), says what a person should know (once per notebook process),
and hands the run to a :class:`colab_xla.notebook.supervisor.Supervisor`, which starts the replicas
and reads them in the calling thread until they end: the caller (the kernel's main thread)
stays interruptible. The notebook's process never initializes the XLA runtime and never
runs a replica.

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

from .. import hardware, interrupts, options, preflight, processes, state
from ...runtimes import jax as jax_runtime
from . import session as sessions
from ...wire.cell import Cell, CellModule
from ..defaults import Defaults
from ..launch import Launch, replica_environ, warm_forkserver
from ..outcome import RunObserver, RunOutcome
from .session import Session, SessionError, SessionOptions, SessionReplicas
from ..supervisor import RunRequest, Supervisor
from ...wire import names


def run_cell(source: str, *, replicas: Optional[int] = None, user_ns: Optional[Mapping] = None,
             label: str = "cell", header: str = "# %%xla_spawn",
             observer: Optional[RunObserver] = None, announce=print,
             timeout: Optional[float] = None, launch: Optional[Launch] = None,
             env: Optional[Mapping[str, str]] = None, cache_dir: Optional[str] = None,
             pull: Sequence[str] = (), pull_from: Optional[int] = None,
             simulate: Optional[str] = None, session: Optional[Session] = None,
             hosted: Optional[interrupts.Remote] = None) -> RunOutcome:
    """Run ``source`` on every replica and return the :class:`RunOutcome`.

    ``launch`` says how replicas start (start method, launcher, one-replica debugging;
    default: fork through xmp.spawn);
    ``env`` adds variables for the replicas only (the replica count and device are
    planned with them); ``cache_dir`` turns on torch_xla's persistent compilation cache,
    a sub-directory per replica process; ``simulate`` is how replicas on CPU simulate a TPU
    host (:mod:`colab_xla.replica.cpu_sim`: "processes", the default, or "threads"; default
    ``$COLAB_XLA_SIMULATE``); ``pull`` names are sent back from every replica
    (or only from replica ``pull_from``) into ``outcome.pulled(name)``.

    With ``session`` (a :class:`colab_xla.notebook.session.Session` that is up), the cell runs on
    the session's replicas, in the globals each keeps from cell to cell; ``replicas``,
    ``env``, ``cache_dir``, ``simulate`` and ``launch`` are the session's and cannot be
    given. A session that ends during the cell says why in ``outcome.session_ended``.

    ``hosted`` makes this a run a cluster's host agent runs for the notebook
    (:mod:`colab_xla.notebook.cluster`): values stay packed for the notebook to load, and the
    agent interrupts the run through it.

    The run ends when every replica has ended; or
    :data:`colab_xla.notebook.supervisor.FAIL_FAST_SECONDS` after the first replica failed; or after
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
    cell = Cell(source, label=label, header=header)  # the one parse of the cell
    if session is not None:
        return _run_on_session(session, cell, replicas=replicas, user_ns=user_ns,
                               observer=observer, announce=announce, timeout=timeout, launch=launch, env=env,
                               cache_dir=cache_dir, pull=pull, pull_from=pull_from,
                               simulate=simulate, hosted=hosted)
    defaults = Defaults.read()
    env, launch = dict(env or {}), launch or Launch()
    simulate = simulate or defaults.simulate
    cache_dir = options.check_run(replicas=replicas, timeout=timeout, env=env, pull=pull,
                                  pull_from=pull_from, cache_dir=cache_dir, launch=launch,
                                  simulate=simulate)
    user_ns = dict(user_ns or {})
    run_dir = state.new_work_dir("run-")
    try:
        module = CellModule.create(cell, run_dir)
        plan, notes = _planned(cell, replicas=replicas, launch=launch, env=env,
                               simulate=simulate, pull_from=pull_from, defaults=defaults)
        sent_names = None
        if launch.start_method != "fork":
            sent_names = names.pack(names.used_names(cell, user_ns), user_ns,
                                   launch.start_method)
        parent_pid = _say_notes(plan, launch, notes, announce)
        request = RunRequest(launch, parent_pid, module, sent_names, cache_dir, tuple(pull),
                             pull_from, hosted)
        return Supervisor(request, plan, run_dir, user_ns, observer or RunObserver(),
                          timeout).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def start_session(opts: SessionOptions, user_ns: Mapping, announce=print) -> Session:
    """Start this notebook process's :mod:`session <colab_xla.notebook.session>` (the one
    ``%%xla_spawn`` cells run on), unless one is up."""
    sessions.check_none_up()
    return sessions.make_current(new_session(opts, user_ns, announce))


def new_session(opts: SessionOptions, user_ns: Mapping, announce=print) -> Session:
    """Start a :class:`colab_xla.notebook.session.Session`, planned and checked as a run is, and
    refused (:class:`colab_xla.errors.SetupError`) as a run is."""
    launch = opts.launch
    if launch.debug_single:
        raise SessionError("--debug-single runs one replica for one run, so a session "
                           "cannot use it: run the cell with %%xla_spawn --debug-single "
                           "(--fresh while a session is up).")
    defaults = Defaults.read()
    simulate = opts.simulate or defaults.simulate
    cache_dir = options.check_run(replicas=opts.replicas, timeout=None, env=dict(opts.env),
                                  pull=(), pull_from=None, cache_dir=opts.cache_dir,
                                  launch=launch, simulate=simulate)
    plan, notes = _planned(None, replicas=opts.replicas, launch=launch, env=dict(opts.env),
                           simulate=simulate, pull_from=None, defaults=defaults)
    parent_pid = _say_notes(plan, launch, notes, announce)
    return Session.start(opts, plan, parent_pid, cache_dir, user_ns)


def _planned(cell: Optional[Cell], *, replicas, launch: Launch, env, simulate,
             pull_from, defaults: Defaults) -> Tuple[hardware.ReplicaPlan, list]:
    """The plan for ``cell`` (None: a session's, before any cell) (device, replica count, processes, and every variable the
    replicas get, ``env`` included), with what would fail refused: the plan, and the
    problems to note."""
    replica_env = replica_environ(env)  # what the replicas will see, --env included
    hw = hardware.detect(replica_env)
    if launch.runtime == "jax":
        jax_runtime.check_installed()
        plan = jax_runtime.plan(replicas, hw, launch.devices_per_process, replica_env)
    else:
        plan = hardware.plan_replicas(replicas, hw, simulate)
    if launch.debug_single:  # one replica, one process, whatever the host has
        if plan.device_type == "CPU":
            plan = hardware.plan_replicas(1, hw, simulate)
        plan = dataclasses.replace(plan, replicas=1, processes=1)
    options.check_pull_from(pull_from, plan.replicas)
    hardware.import_torch_xla()
    problems = preflight.check(cell, replica_env, launch, plan.device_type,
                               defaults.refuses_tpu_holders(env))
    if launch.runtime == "jax":
        problems["fatal"] += filter(None, [jax_runtime.backend_problem()])
    for problem in problems["fatal"]:
        raise preflight.refusal(problem)
    changes = {**env, **plan.env, **preflight.topology_changes(replica_env, plan.env)}
    return dataclasses.replace(plan, env=changes), problems["notes"]


def _say_notes(plan: hardware.ReplicaPlan, launch: Launch, problems, announce) -> int:
    """Say what a person should know before the replicas start (once per notebook
    process; leftover processes on every run), warming the forkserver if it is used.
    Return the replica processes' parent pid: this process's, or the forkserver's."""
    notes = [_once(plan.note), _once(_start_note(launch))]
    parent_pid = os.getpid()  # of the replica processes (each checks it)
    if launch.start_method == "forkserver":
        parent_pid, started = warm_forkserver()
        if started:
            notes.append(FORKSERVER_STARTING)
    notes += [_once(f"colab_xla: {p.message} {p.fix}") for p in problems]
    leftovers = preflight.leftovers_problem(processes.leftovers())
    if leftovers:  # said on every run until they are gone
        notes.append(f"colab_xla: {leftovers.message} {leftovers.fix}")
    for note in filter(None, notes):
        if announce:
            announce(note)
    return parent_pid


def _run_on_session(session: Session, cell: Cell, *, replicas, user_ns, observer, announce, timeout, launch, env, cache_dir, pull, pull_from,
                    simulate, hosted) -> RunOutcome:
    """:func:`run_cell` on a session's replicas."""
    session.check_cell_options(replicas=replicas, launch=launch, env=env or {},
                               cache_dir=cache_dir, simulate=simulate)
    session.check_up()
    options.check_run(replicas=None, timeout=timeout, env={}, pull=pull, pull_from=pull_from,
                      cache_dir=None, launch=Launch())
    options.check_pull_from(pull_from, session.plan.replicas)
    user_ns = user_ns if user_ns is not None else {}
    run_dir = state.new_work_dir("run-")
    try:
        # The cell's file lives as long as the session: what it defines is called later.
        module = CellModule.create(cell, session.directory)
        problems = preflight.check(cell, os.environ)
        for problem in problems["fatal"]:
            raise preflight.refusal(problem)
        for problem in problems["notes"]:
            note = _once(f"colab_xla: {problem.message} {problem.fix}")
            if note and announce:
                announce(note)
        if hosted is None:
            sent_names, sent = session.known.pack(cell, user_ns)
        else:  # a cluster host's: the notebook chose the names to send (all it sent here)
            sent_names, sent = (names.pack(user_ns, user_ns, names.SESSION) if user_ns
                                else None), []
        request = RunRequest(session.options.launch, os.getpid(), module, sent_names, None,
                             tuple(pull), pull_from, hosted)
        outcome = Supervisor(request, session.plan, run_dir, dict(user_ns),
                             observer or RunObserver(), timeout,
                             replicas=SessionReplicas(session)).run()
        session.known.sent(sent, user_ns)
        if not session.up:
            outcome.session_ended = session.ended
        return outcome
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


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


def _once(note: Optional[str]) -> Optional[str]:
    """``note`` the first time this notebook process sees it, else None."""
    if note is None or note in _said:
        return None
    _said.add(note)
    return note


_said: set = set()  # notes said once per notebook process
