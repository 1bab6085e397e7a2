"""IPython glue: each magic parses its line, asks the IPython-free core
(:mod:`colab_xla.notebook.targets`) for the target, runs the request on it, and hands the
outcome to a view."""

from __future__ import annotations

import argparse
import inspect
import os
import time
from typing import Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments

from . import auto_cells, doctor, processes, targets, views
from .. import runtimes
from ..errors import RuntimeInitializedError, SetupError
from ..runtimes import RUNTIMES
from ..wire.cell import Cell, EmptyCellError
from .chosen import parse as parse_targets
from .defaults import Defaults
from .launch import LAUNCHERS, START_METHODS
from .options import (SIMULATIONS, check_cluster_line, check_output, check_session_line,
                      parse_env, pull_names, split_line)
from .outcome import XlaSpawnError, interrupted_error
from .request import DEFAULT_STALL_SECONDS, CellRequest, LaunchAsked, SessionRequest


class _Help(argparse.RawDescriptionHelpFormatter):
    """A magic's help as IPython's own magics print theirs, in plain text: the usage line,
    the docstring as written (a summary and an example), the options, its docs page."""

    def _fill_text(self, text, width, indent):
        return super()._fill_text(inspect.cleandoc(text), width, indent)

    def add_usage(self, usage, actions, groups, prefix=None):
        super().add_usage(usage, actions, groups, "Usage: ")

    def _format_action_invocation(self, action):
        # "-n N, --replicas N" on every Python (3.13's argparse writes "-n, --replicas N")
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        value = self._format_args(action, action.dest.upper())
        return ", ".join(f"{option} {value}" for option in action.option_strings)


def help_of(name: str, page: str):
    """``magic_arguments`` for the magic typed as ``name`` (``%%xla_spawn``), whose help
    ends with its page of docs/."""
    def parsed(magic):
        magic = kwds(formatter_class=_Help,
                     epilog=f"Docs: docs/{page} in colab_xla's repository.")(magic)
        return magic_arguments(name)(magic)
    return parsed


@magics_class
class XlaMagics(Magics):
    """The ``%%xla_spawn`` cell magic and the ``%xla_session``, ``%xla_cluster``,
    ``%xla_debug`` and ``%xla_doctor`` line magics."""

    _told_terminal = False

    @help_of("%%xla_spawn", "xla_spawn.md")
    @argument("-n", "--replicas", "--nprocs", type=int, metavar="N", default=None,
              help="number of replicas. On CPU: N simulated replicas (1 to 128; default: "
                   "$CPU_NUM_DEVICES, else 8), see --simulate. On a TPU "
                   "host: every TPU core, the only count xmp.spawn accepts (leave -n out). "
                   "--nprocs is the same option, under xmp.spawn's name.")
    @argument("-o", "--output", metavar="NAME", default=None,
              help="store {ordinal: value} of the cell's last expression in the notebook "
                   "variable NAME (XLA tensors arrive as CPU tensors).")
    @argument("-t", "--timeout", type=float, metavar="SECONDS", default=None,
              help="stop the run after SECONDS (default: none, training can take hours); "
                   "replicas still running are stopped (their processes killed) and reported "
                   "with their last output line.")
    @argument("--stall", type=float, metavar="SECONDS", default=DEFAULT_STALL_SECONDS,
              help="when no replica has printed anything for SECONDS (default 60; 0: never), "
                   "the live view shows where each replica is (its line in the cell and the "
                   "call it waits in), refreshed while it lasts, gone when output resumes; "
                   "nothing is stopped.")
    @argument("--no-widget", action="store_true",
              help="show live output as text lines ([replica 3] ...) instead of the widget "
                   "(also: COLAB_XLA_VIEW=text in the environment).")
    @argument("--pull", metavar="NAME[,NAME...]", action="append", default=[],
              help="after the run, bring these names of the replicas' namespaces back into "
                   "the notebook, each as {ordinal: value} (XLA tensors, also inside models "
                   "and state dicts, arrive on CPU; large tensors through shared memory). "
                   "Repeatable.")
    @argument("--pull-from", type=int, metavar="ORDINAL", default=None,
              help="with --pull: take the names from this replica only, as plain values "
                   "(--pull model --pull-from 0: `model` is replica 0's trained model).")
    @argument("--start-method", choices=START_METHODS, default=None,
              help="fork (default; also $COLAB_XLA_START_METHOD): replicas inherit every "
                   "notebook name. spawn: fresh interpreters, safe after CUDA or threads, "
                   "seconds per run. forkserver: as safe, forked from a server that keeps "
                   "torch and torch_xla imported (first run waits for it, then fast). "
                   "Without fork, replicas get the notebook names the cell mentions, sent "
                   "with cloudpickle.")
    @argument("--simulate", choices=SIMULATIONS, default=None,
              help="how replicas on CPU (no TPU) simulate a TPU host. processes (default; "
                   "also $COLAB_XLA_SIMULATE): one process per replica, as on TPU v4 and "
                   "later, each with its own random generators, process group and modules; "
                   "collectives go through shared memory (gloo between a cluster's hosts). "
                   "threads: one process whose CPU devices are "
                   "the replicas, threads, as on TPU v2/v3.")
    @argument("--launcher", choices=LAUNCHERS, default="xmp",
              help="xmp (default): xmp.spawn. launch: torch_xla.launch (same results). "
                   "(Several CPU replicas as processes are started by colab_xla itself: "
                   "xmp.spawn runs one CPU process.)")
    @argument("--debug-single", action="store_true",
              help="run one replica (index 0) in a process of its own, through "
                   "torch_xla.launch(debug_single_process=True), for debugging.")
    @argument("--env", metavar="KEY=VALUE", action="append", default=[],
              help="set an environment variable for the replicas only (XLA_FLAGS, "
                   "XLA_IR_DEBUG...). Repeatable. The line is split as a shell would: "
                   "quote a value with spaces, --env XLA_FLAGS=\"--xla_a --xla_b\".")
    @argument("--cache", metavar="DIR", default=None,
              help="torch_xla's persistent compilation cache in DIR, one sub-directory per "
                   "replica process: a rerun on a TPU loads compiled programs instead of "
                   "compiling. (On CPU, XLA cannot load them back: it compiles again.)")
    @argument("--runtime", choices=RUNTIMES, default=None,
              help="torch_xla (default): XLA replicas. jax: N JAX processes (-n, default "
                   "2 on CPU; one per TPU host) with jax.distributed initialized before the "
                   "cell, so jax.process_index(), the global jax.devices() and collectives "
                   "across processes work, and torchax on top; `index` is the process "
                   "index, `device` its first local device; -o and --pull give JAX arrays as "
                   "NumPy arrays, torchax tensors as CPU tensors. torch: N "
                   "torch.distributed processes as torchrun starts them (RANK, WORLD_SIZE, "
                   "MASTER_ADDR, ...), the default process group initialized before the "
                   "cell (gloo on CPU, -n default 8; NCCL with one process per CUDA GPU); "
                   "`index` is the RANK, `device` the process's device; a cell written as a "
                   "torchrun script runs unchanged. On a cluster (%%xla_cluster): every "
                   "host's replicas (one per TPU host) are the processes of one job.")
    @argument("--devices-per-process", type=int, metavar="K", default=None,
              help="with --runtime jax on CPU: K devices per process (XLA's host platform "
                   "device count; default 1).")
    @argument("--targets", metavar="R[,R...]", default=None,
              help="in a session, run the cell on these replicas only (0,2; ranges 0-3; on a "
                   "cluster's session HOST:R too); the others stay idle and keep their state. "
                   "A cell that enters a collective waits for the others: the stall notice "
                   "says so.")
    @argument("--fresh", action="store_true",
              help="while a session is up (%%xla_session) or a cluster is connected "
                   "(%%xla_cluster), run this cell as a one-off run on this machine instead, "
                   "on replicas of its own (the options above apply).")
    @cell_magic
    def xla_spawn(self, line, cell):
        """Run the cell on every XLA replica (N simulated ones on a CPU).

        Each replica runs the cell with the notebook's names and three of its own: index
        (its ordinal), device (its XLA device) and lock (with lock: print(...)). Its
        output, the value of the cell's last expression, its error and its time come back
        to the notebook, live while it runs; one replica's failure stops the run.

        Example:

            %%xla_spawn -n 4 -o sums
            import torch, torch_xla.core.xla_model as xm
            xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=device) * index).cpu()
        """
        began = time.monotonic()  # (the run's time is the wait: its start-up included)
        auto = auto_cells.made_here(line, cell)  # (first: the body's transform is next)
        args = _parse(self.xla_spawn, line, "%%xla_spawn")
        defaults = Defaults.read()
        try:
            pull = pull_names(args.pull)
            check_output(args.output, pull)
            launch = LaunchAsked(args.start_method, args.launcher, args.debug_single,
                                 args.runtime, args.devices_per_process,
                                 default_start_method=defaults.start_method)
            launch.one_off()  # (what a one-off run would refuse is refused on any target)
            env = parse_env(args.env)
            chosen = None if args.targets is None else parse_targets(args.targets)
        except SetupError as exc:
            raise UsageError(str(exc)) from None
        with auto_cells.suspended():  # (its body is the replicas': never transformed again)
            body = self.shell.transform_cell(cell)
        request = CellRequest(
            Cell(body, label=f"Cell In[{self._cell_number()}]",
                 header=None if auto else f"# %%xla_spawn {line}".rstrip()),
            user_ns=self.shell.user_ns, replicas=args.replicas, launch=launch, env=env,
            cache_dir=args.cache, simulate=args.simulate, timeout=args.timeout, stall=args.stall,
            pull=tuple(pull), pull_from=args.pull_from, targets=chosen, defaults=defaults,
            began=began)
        target = targets.current(fresh=args.fresh)
        try:
            target.refuse(request)
            view = self._view(args.no_widget, defaults)
            outcome = target.run(request, view)
        except SetupError as exc:  # refused before anything started; nothing else is caught
            raise UsageError(self._refusal(exc)) from None
        self._show(outcome, view, args, pull)

    def _show(self, outcome, view, args, pull) -> None:
        """Store the run's values, close its view, and say how it ended."""
        if outcome.cluster_ended:
            print(f"colab_xla: the cluster connection ended: {outcome.cluster_ended}; its "
                  "agents were stopped. %xla_cluster connect (or local) connects again.")
        # Values first, then the closing draw: a view that fails cannot lose them. Where
        # they went is a clause of the headline.
        outcome.kept = self._store(outcome, args.output, pull, args.pull_from)
        outcome.stored_as = args.output if f"-o {args.output}" not in outcome.kept else None
        view.closed(outcome)
        if outcome.session_ended:
            reason, _, printed = outcome.session_ended.partition("\n")
            print(f"colab_xla: the session ended: {reason}; every process it started was "
                  "killed. %xla_session restart starts it again (%xla_session start: a new "
                  "one)." + (f"\n{printed}" if printed else ""))
        if outcome.interrupted:
            raise interrupted_error()
        if not outcome.ok:
            raise XlaSpawnError(outcome)

    @help_of("%xla_session", "sessions.md")
    @argument("action", nargs="?", default="status",
              choices=("start", "status", "stop", "restart", "auto"),
              help="start: start the replicas and keep them. status (default): the replicas, "
                   "their pids, memory, cells run, auto mode. stop: end them (every process "
                   "the session started; auto mode ends too). restart: stop, then start with "
                   "the same options. auto [on|off]: every following cell runs on the "
                   "replicas as if it began with %%%%xla_spawn (on), or in the notebook again "
                   "(off).")
    @argument("switch", nargs="?", choices=("on", "off"), default=None,
              help="for auto: on (default) or off.")
    @argument("--auto", action="store_true",
              help="start (or restart) in auto mode: see auto.")
    @argument("-n", "--replicas", type=int, metavar="N", default=None,
              help="number of replicas, as for %%%%xla_spawn (start only).")
    @argument("--start-method", choices=START_METHODS, default=None,
              help="fork (default; also $COLAB_XLA_START_METHOD), spawn or forkserver, as "
                   "for %%%%xla_spawn (start only).")
    @argument("--simulate", choices=SIMULATIONS, default=None,
              help="on CPU: processes (default) or threads, as for %%%%xla_spawn (start only). "
                   "With threads, an Interrupt reaches a cell at its next Python line.")
    @argument("--env", metavar="KEY=VALUE", action="append", default=[],
              help="an environment variable for the replicas (start only). Repeatable.")
    @argument("--cache", metavar="DIR", default=None,
              help="torch_xla's persistent compilation cache in DIR (start only).")
    @argument("--runtime", choices=RUNTIMES, default=None,
              help="torch_xla (default), jax (JAX processes with jax.distributed "
                   "initialized once) or torch (torch.distributed processes with the default "
                   "process group initialized once), as for %%%%xla_spawn --runtime "
                   "(start only).")
    @argument("--devices-per-process", type=int, metavar="K", default=None,
              help="with --runtime jax on CPU: K devices per process (start only).")
    @line_magic
    def xla_session(self, line):
        """Keep replicas warm across cells: after start, every %%xla_spawn cell runs
        on the same replicas, each keeping its globals from cell to cell.

        auto makes every following cell run on them without the magic; Interrupt stops
        the cell and keeps the session; a replica that dies ends it (restart: again).

        Example:

            %xla_session start -n 4 --auto
            %xla_session stop
        """
        args = _parse(self.xla_session, line, "%xla_session")
        request = SessionRequest(
            replicas=args.replicas, start_method=args.start_method, simulate=args.simulate,
            env=tuple(args.env), cache_dir=args.cache, runtime=args.runtime,
            devices_per_process=args.devices_per_process, defaults=Defaults.read())
        try:
            check_session_line(args.action, request.given(), args.switch, args.auto)
        except SetupError as exc:
            raise UsageError(str(exc)) from None
        session = targets.current_session()
        if args.action == "auto":
            self._auto(session, args.switch != "off")
            return
        if args.action == "status":
            on_hosts = " on every host" if targets.connected_cluster() else ""
            print(session.describe() if session is not None else "colab_xla session: none "
                  f"(%xla_session start starts one{on_hosts}).")
            if session is not None:
                print(self._auto_status())
            return
        if args.action == "stop":
            was_up = session is not None and session.up
            auto = " (auto mode ended with it)" if auto_cells.state.on else ""
            auto_cells.state.on = False
            targets.stop_session()
            print(f"colab_xla session: stopped{auto}." if was_up else
                  "colab_xla session: none was up." if session is None else
                  f"colab_xla session: it had ended already ({session.ended}).")
            return
        try:
            started = targets.start_asked_session(request, self.shell.user_ns,
                                                  restart=args.action == "restart")
        except SetupError as exc:
            raise UsageError(self._refusal(exc)) from None
        print(started.describe_start())
        print(started.describe())
        if args.auto:
            self._auto(started, True)

    def _auto(self, session: Optional[targets.SessionTarget], on: bool) -> None:
        """``%xla_session auto [on|off]``."""
        if on and (session is None or not session.up):
            raise UsageError("%xla_session auto: no session is up"
                             + (f" (it ended: {session.ended})" if session is not None else "")
                             + ". %xla_session start --auto starts one in auto mode.")
        auto_cells.state.on = on
        print(self._auto_status())

    @staticmethod
    def _auto_status() -> str:
        if auto_cells.state.on:
            return ("auto: on (every cell runs on the session's replicas as if it began with "
                    "%%xla_spawn; %xla_ magics and %%xla_local cells run in the notebook; "
                    "%xla_session auto off ends it).")
        return ("auto: off (cells run in the notebook; %xla_session auto sends every cell "
                "to the replicas).")

    @cell_magic
    def xla_local(self, line, cell):
        """Usage: %%xla_local

        Run the cell in the notebook, not on the replicas: for one cell while
        %xla_session auto sends every cell to the session's replicas.

        Example:

            %%xla_local
            losses = {}      # a notebook name, as without auto mode

        Docs: docs/sessions.md in colab_xla's repository.
        """
        if line.strip():
            raise UsageError(f"%%xla_local takes no options (got {line.strip()!r}).")
        with auto_cells.suspended():
            self.shell.run_cell(cell)

    @help_of("%xla_cluster", "clusters.md")
    @argument("action", nargs="?", default="status",
              choices=("connect", "local", "status", "stop"),
              help="connect: join a Ray cluster and start an agent on each host. local: "
                   "start a Ray cluster of --hosts CPU hosts on this machine (workshops, "
                   "tests) and connect to it. status (default): the hosts, their replicas "
                   "and agents. stop: end the agents (and the local cluster).")
    @argument("address", nargs="?", default="auto",
              help="with connect: ray.init's address (auto, the default: the cluster this "
                   "machine is part of; ray://head:10001; or the head's GCS address).")
    @argument("--hosts", type=int, metavar="H", default=None,
              help="CPU hosts: use H hosts (nodes with a CPU) of the cluster, with -n. "
                   "Without it, connect finds the cluster's TPU slices (Ray's TPU labels).")
    @argument("-n", "--replicas", type=int, metavar="N", default=None,
              help="with --hosts: replicas per CPU host (torch_xla's CPU backend, one "
                   "process each). On a TPU slice each host runs one replica per core.")
    @argument("--slice", metavar="NAME[,NAME]", default=None,
              help="with connect: the TPU slice(s) to use when the cluster has several "
                   "(default: every one; several are one multislice job).")
    @argument("--slices", type=int, metavar="S", default=None,
              help="with --hosts: the hosts simulate S slices of H/S hosts (each host gets "
                   "its MegaScale variables, as on a multislice TPU job).")
    @line_magic
    def xla_cluster(self, line):
        """Run %%xla_spawn cells on every host of a cluster (a TPU pod slice, or CPU
        hosts), through Ray: one agent per host, every replica of every host in one run.

        Each replica also gets host (its host's rank) and local_index; index counts every
        host's replicas. Needs pip install 'colab_xla[ray]' here and on every host.

        Example:

            %xla_cluster local --hosts 2 -n 2
            %xla_cluster stop
        """
        args = _parse(self.xla_cluster, line, "%xla_cluster")
        try:
            check_cluster_line(args.action, address=args.address, hosts=args.hosts,
                               replicas=args.replicas, slice_name=args.slice, slices=args.slices)
        except SetupError as exc:
            raise UsageError(str(exc)) from None
        connected = targets.connected_cluster()
        if args.action == "status":
            print(connected.describe() if connected is not None else
                  "colab_xla cluster: not connected (%xla_cluster connect, or local).")
            return
        if args.action == "stop":
            stopped = targets.stop_cluster()
            print("colab_xla cluster: stopped." if connected is not None else
                  "colab_xla cluster: none was connected." if stopped is None else
                  f"colab_xla cluster: its connection had ended already ({stopped.ended}).")
            return
        started = time.monotonic()
        try:
            cluster = targets.connect_cluster(args.address, hosts=args.hosts,
                                              replicas=args.replicas, slice_name=args.slice,
                                              slices=args.slices, local=args.action == "local")
        except SetupError as exc:
            raise UsageError(str(exc)) from None
        print(f"colab_xla cluster: {len(cluster.hosts)} hosts ready in "
              f"{time.monotonic() - started:.1f} s.")
        print(cluster.describe())

    def _refusal(self, exc: SetupError) -> str:
        """What the person reads when a run is refused."""
        if isinstance(exc, EmptyCellError):
            return ("The %%xla_spawn cell is empty: write the code every replica runs below "
                    "the %%xla_spawn line.")
        if isinstance(exc, RuntimeInitializedError):
            cause = doctor.likely_cause(self.shell.user_ns.get("In", ()),
                                        runtimes.started_by(exc.problem))
            return str(exc) + (f"\nLikely: {cause}." if cause else "")
        return str(exc)

    def _store(self, outcome, output, pull, pull_from) -> list:
        """Put ``-o`` and ``--pull`` values in the notebook. A run that failed or was
        interrupted before any value came back leaves an earlier value of the name as it
        was (a rerun must not swap a good result for ``{}``); the names kept are returned."""
        user_ns, kept = self.shell.user_ns, []
        if output is not None:
            results = outcome.results()
            if results or outcome.ok or output not in user_ns:
                user_ns[output] = results
            else:
                kept.append(f"-o {output}")
        for name in pull:
            values = outcome.pulled(name)
            if pull_from is not None:
                values = {pull_from: values[pull_from]} if pull_from in values else {}
            if values:
                user_ns[name] = values if pull_from is None else values[pull_from]
            elif name in user_ns and not outcome.ok:
                kept.append(f"--pull {name}")
        return kept

    @help_of("%xla_debug", "sessions.md")
    @argument("replica", nargs="?", default=None,
              help="the replica whose last exception to debug (default: the lowest replica "
                   "that failed in the session's last cell); on a cluster's session also "
                   "HOST:R (replica R of host HOST).")
    @line_magic
    def xla_debug(self, line):
        """A post-mortem debugger (pdb) on a session replica's last exception, at the
        cell's line that raised, with the replica's frames and locals; q ends it and the
        session goes on.

        Example:

            %xla_session start -n 4
            %%xla_spawn
            x = 1 / (index - 2)     # replica 2 fails
            %xla_debug              # (Pdb) p index  ->  2
        """
        args = _parse(self.xla_debug, line, "%xla_debug")
        try:
            asked = (None if args.replica is None else
                     tuple(int(p) for p in args.replica.split(":")) if ":" in args.replica
                     else int(args.replica))
        except ValueError:
            raise UsageError(f"%xla_debug {args.replica}: a replica's ordinal (3), or on a "
                             "cluster HOST:R (1:0).") from None
        session = targets.current_session()
        if session is None or not session.up:
            raise UsageError("%xla_debug needs the replicas alive: a one-off run's are gone "
                             "when it ends. Start a session (%xla_session start), run the "
                             "cell again there, then %xla_debug.")
        try:
            ended = session.debug(asked, ask=input,
                                  show=lambda text: print(text, end="", flush=True))
        except SetupError as exc:
            raise UsageError(str(exc)) from None
        if ended != "ended":
            print(f"colab_xla: the debugger was left: {ended}; the session goes on "
                  "(%xla_debug again opens it anew).")

    @help_of("%xla_doctor", "troubleshooting.md")
    @argument("--kill-leftovers", action="store_true",
              help="kill the processes that earlier runs started in notebook processes that "
                   "are gone (found by pid and start time; nothing else is touched).")
    @line_magic
    def xla_doctor(self, line):
        """Say where this notebook runs and what would stop %%xla_spawn, with fixes,
        without initializing the XLA runtime.

        Example:

            %xla_doctor
        """
        args = _parse(self.xla_doctor, line, "%xla_doctor")
        if args.kill_leftovers:
            killed = processes.kill_leftovers()
            print(f"killed {len(killed)} leftover process(es)"
                  + "".join(f"\n  {k.describe()}" for k in killed))
        print(doctor.diagnose(os.environ, self.shell.user_ns.get("In", ())).render())

    def _view(self, no_widget: bool, defaults: Defaults):
        """The one place that chooses between the widget and text views."""
        wanted = "text" if no_widget else defaults.view
        has_kernel = getattr(self.shell, "kernel", None) is not None
        if not has_kernel and not self._told_terminal:
            self._told_terminal = True
            print("colab_xla: no Jupyter kernel here (terminal IPython?): output is shown "
                  "as text. The live widget needs Jupyter, Colab or Kaggle.")
        return views.choose(wanted, has_kernel)

    def _cell_number(self) -> int:
        """The running cell's In[N]. IPython stores the input under N before running it,
        but increments ``execution_count`` before the cell on IPython 8+ and after it on
        IPython 7 (Colab), so the history is the one that tells."""
        history = getattr(self.shell.history_manager, "input_hist_raw", None)
        return len(history) - 1 if history else self.shell.execution_count


def _parse(magic, line: str, name: str):
    """The magic's arguments from its line, split as a shell would (quotes group and are
    removed: IPython's parse_argstring keeps them in the values); bad flags, values and
    quotes are UsageErrors."""
    try:
        argv = split_line(line, name)
    except SetupError as exc:
        raise UsageError(str(exc)) from None
    return magic.parser.parse_args(argv)
