"""A cluster host's agent: the one long-lived process per host (a Ray actor) that runs
each ``%%xla_spawn`` cell on its host's replicas for the notebook.

It is, for its host, what the notebook's process is on a single host: it keeps torch and
torch_xla imported (never the runtime: it is not a replica), plans its replicas, and runs
the cell with the machinery of one-off runs (the target
:class:`~colab_xla.notebook.targets.one_off.OneOff`: xmp.spawn, capture, reports, fail-fast on
the host), or on its host's session, in a thread of its own. What the run's view
would see becomes events the notebook collects with :meth:`HostAgent.poll` (a Ray call
that waits for news), so the notebook draws every host in one view; values and ``--pull``
names stay packed bytes, loaded in the notebook where its classes are.

A cell of another runtime (``--runtime jax``) runs the same way, as the host's replicas
of that runtime; the notebook tells every host the runtime and what its replicas get
(:func:`colab_xla.notebook.targets.cluster_run.host_request`: for JAX, the coordinator host 0's
agent chose, :meth:`HostAgent.coordinator`), and each process's id is its global
ordinal.

An Interrupt from the notebook (:meth:`HostAgent.interrupt`) stops the host's run as the
notebook's Interrupt stops a local one (``ray.cancel`` cannot stop a running actor task).
Ray-free itself: :mod:`colab_xla.notebook.cluster.connection` makes it an actor.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import socket
import threading
import traceback
from typing import Any, Dict, List, MutableMapping, Optional

from ... import runtimes
from ...errors import SetupError
from ...runtimes.torch import listening_store
from ...wire import names
from ...wire.host_rank import SKIP_DISCOVERY, VARIABLES, HostRank
from .. import debugger, interrupts
from ..chosen import parse
from ..launch import Launch, forkserver_pid, free_port, wait_forkserver, warm_forkserver
from ..outcome import RunObserver, RunOutcome
from ..request import CellRequest, LaunchAsked
from ..targets.one_off import OneOff
from ..targets.session import SessionOptions, new_session
from ..torch_xla_import import import_torch_xla
from . import multislice

# What Ray sets in an actor's environment for the chips it reserved, which the replicas
# of a whole host must not inherit (TPU_HOST_BOUNDS=1,1,1 makes one host its own slice);
# and what an earlier job may have left: stale MegaScale values hang libtpu.
STALE_VARIABLES = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS",
                   *VARIABLES, *multislice.VARIABLES, SKIP_DISCOVERY)


def host_environment(environ: MutableMapping[str, str], rank: HostRank, device: str,
                     hostnames: List[str],
                     slices: Optional[multislice.Slices] = None) -> Dict[str, str]:
    """Drop from ``environ`` (the agent's) what Ray set for the chips it reserved and
    stale MegaScale values; return what this host's replicas get on top: on a TPU host its
    worker id and the addresses of its slice's hosts, on a CPU host torch_xla's CPU
    backend; on a cluster of several ``slices``, this host's MegaScale variables."""
    for name in STALE_VARIABLES:
        environ.pop(name, None)
    env = {"PJRT_DEVICE": "CPU"}
    if device == "TPU":
        worker, members = ((slices.worker_of(rank.host), slices.members(rank.host, hostnames))
                           if slices else (rank.host, hostnames))
        env = {"TPU_WORKER_ID": str(worker), "TPU_WORKER_HOSTNAMES": ",".join(members)}
    return {**env, **(slices.environ(rank.host) if slices else {})}


class HostAgent:
    """Host ``rank.host`` of a cluster. ``device`` is "TPU" (replicas on its chips, as
    many as torch_xla plans) or "CPU" (``rank.replicas`` replicas, one process each,
    their collectives through gloo across hosts); ``hostnames`` are every host's address
    by rank (``TPU_WORKER_HOSTNAMES``); ``slices``, the cluster's slices if several."""

    def __init__(self, rank: HostRank, device: str, hostnames: List[str],
                 start_method: str = "forkserver",
                 slices: Optional[multislice.Slices] = None):
        self.env = host_environment(os.environ, rank, device, hostnames, slices)
        self.rank, self.device = rank, device
        self.start_method = start_method
        self._store = None
        if device == "CPU" and rank.host == 0:  # where the replicas of every host meet
            # (on this host's address alone, not every interface; its keys under a secret
            # the store's address brings: anyone who reaches the address can connect)
            self._store = listening_store(rank.address, 0, wait_for_workers=False)
            self.rank = dataclasses.replace(
                rank, store=f"{rank.address}:{self._store.port}/{secrets.token_hex(16)}")
        if start_method == "forkserver":
            # Started now, not by a cell's run (which would end it with the run). Replicas
            # must not fork from this process: Ray's threads may hold libc's locks (a
            # child forked here was seen stuck in getnameinfo, making its gloo store).
            warm_forkserver()  # (it imports torch_xla beside this process's import)
        import_torch_xla()  # warm: every cell's replicas start from here
        if start_method == "forkserver":
            # Waited for here, not by the first cell: a cell cut while its replicas wait
            # for the forkserver's imports would wait for them too, and under load that
            # is longer than the notebook gives a host to stop (a host taken as gone).
            wait_forkserver()
        self._runs: Dict[str, _HostedRun] = {}
        self._lock = threading.Lock()
        self._session = None  # this host's warm replicas (targets.session.Session), if up
        self._debugger = None  # %xla_debug's, relayed to the notebook (debugger.Relayed)

    def describe(self) -> Dict[str, Any]:
        """What the notebook shows of this host."""
        import torch_xla  # (already imported: import_torch_xla; never in the notebook's process)

        return {"host": self.rank.host, "pid": os.getpid(), "forkserver": forkserver_pid(),
                "hostname": socket.gethostname(),
                "address": self.rank.address, "device": self.device,
                "replicas": self.rank.replicas, "store": self.rank.store,
                "env": dict(self.env),
                "torch_xla": getattr(torch_xla, "__version__", "?")}

    def set_store(self, store: Optional[str]) -> None:
        """The store host 0 keeps (CPU hosts), told to every host before the first cell."""
        self.rank = dataclasses.replace(self.rank, store=store)

    # -- warm replicas (%xla_session on the cluster) ----------------------------------------

    def start_session(self, session_id: str, request: Optional[Dict[str, Any]] = None
                      ) -> Dict[str, Any]:
        """Start this host's warm replicas, whose cells :meth:`start` then runs (in
        ``request``'s runtime, as for :meth:`start`); reply ``{"replicas": {local
        ordinal: pid}, "notes": [...]}``, or ``{"error": (ename, message)}`` when they
        could not start (refused, or did not come up)."""
        self.stop_session()
        notes: List[str] = []
        opts = SessionOptions(replicas=self._replicas(), launch=self._launch(request),
                              env=self._environ(session_id, request), simulate="processes")
        try:
            self._session = new_session(opts, {}, announce=notes.append)
        except SetupError as exc:
            return {"error": (type(exc).__name__, str(exc)), "notes": notes}
        return {"replicas": {i: r.pid for i, r in self._session.replicas.items()},
                "notes": notes}

    def debug(self, local: int, answer: Optional[str]) -> Dict[str, Any]:
        """``%xla_debug`` of this host's session replica ``local`` (``answer`` None: start
        it; else the answer to its last prompt): what pdb wrote since, and its next prompt
        or how it ended (:class:`colab_xla.notebook.debugger.Relayed`)."""
        if answer is None:
            session = self._session
            if session is None or not session.up:
                return {"output": "", "prompt": None, "ended": "no session is up on this host"}
            self._debugger = debugger.Relayed(
                lambda ask, show: session.debug(local, ask=ask, show=show))
        return self._debugger.step(answer)

    def stop_session(self) -> None:
        """End this host's warm replicas, if any (every process they started)."""
        session, self._session = self._session, None
        if session is not None:
            session.stop()

    def session_status(self) -> Optional[str]:
        """This host's warm replicas as ``%xla_session`` shows them (None: none)."""
        return None if self._session is None else self._session.describe()

    # -- cells --------------------------------------------------------------------------------

    def start(self, run_id: str, cell, sent: Optional[bytes], pull: List[str],
              pull_from: Optional[int], request: Optional[Dict[str, Any]] = None) -> None:
        """Start running ``cell`` (a :class:`colab_xla.wire.cell.Cell`, as the notebook
        parsed it) on this host's replicas (returns at once), with ``sent``, the notebook
        names it uses, packed: on the warm ones, if a session is up, else on replicas of
        the run's own, in ``request``'s runtime (``{"runtime": name, "devices_per_process":
        K or None, "environ": {...}}``, what every host's replicas get; None: the default
        runtime's), one job with every host's; its ``"targets"`` (``"0,2"``, by index on
        this host: ``--targets``) runs it on those of the session's replicas only."""
        run = self._run(run_id)
        target, asked = self._session, {"stall": (request or {}).get("stall")}
        if (request or {}).get("targets"):  # (the notebook chose them, by index here)
            asked["targets"] = parse(request["targets"])
        if target is None:
            target, asked = OneOff(), dict(asked, env=self._environ(run_id, request),
                                           replicas=self._replicas(),
                                           launch=LaunchAsked.of(self._launch(request)),
                                           simulate="processes")
        thread = threading.Thread(
            target=run.run, name=f"colab_xla-host-run-{run_id}", daemon=True,
            args=(self.rank.host, cell, sent, target, asked, pull, pull_from))
        thread.start()

    def _environ(self, run: str, request: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
        """What the replicas of run (or session) ``run`` get on top of the agent's."""
        request = request or {}
        runtime = runtimes.get(request.get("runtime"))
        # The host's replicas in that runtime (JAX on a TPU host: one process, whose
        # global ordinal is the host's).
        replicas = runtime.cluster_replicas({"device": self.device,
                                             "replicas": self.rank.replicas})
        rank = dataclasses.replace(self.rank, run=run, replicas=replicas)
        return {**self.env, **rank.environ(), **request.get("environ", {})}

    def _replicas(self) -> Optional[int]:
        # TPU: torch_xla's replicas are its chips; JAX's, one process driving them.
        return self.rank.replicas if self.device == "CPU" else None

    def _launch(self, request: Optional[Dict[str, Any]] = None) -> Launch:
        request = request or {}
        return Launch(start_method=self.start_method, runtime=request.get("runtime"),
                      devices_per_process=request.get("devices_per_process"))

    def coordinator(self) -> str:
        """Where a job's processes meet (host 0's agent is asked, per run or session):
        this host's address and a port free on it now. Process 0, which runs here,
        serves it, listening on that address alone (not every interface:
        :func:`colab_xla.runtimes.jax.initialize`)."""
        return f"{self.rank.address}:{free_port(self.rank.address)}"

    def poll(self, run_id: str, wait: float) -> Dict[str, Any]:
        """The run's events since the last poll (waiting up to ``wait`` s for one), and
        its end: ``{"events": [...], "done": bool, "outcome": {...} when done}``."""
        reply = self._run(run_id).take(wait)
        if reply["done"]:
            with self._lock:
                self._runs.pop(run_id, None)
        return reply

    def interrupt(self, run_id: str) -> None:
        """Stop the run ``run_id`` on this host, as the notebook's Interrupt would."""
        self._run(run_id).interrupter.request()

    def _run(self, run_id: str) -> "_HostedRun":
        """The run ``run_id`` (Ray may deliver a poll or an interrupt before the start)."""
        with self._lock:
            return self._runs.setdefault(run_id, _HostedRun())


class _HostedRun(RunObserver):
    """One cell on this host: run_cell in a thread, its view's hooks kept as events."""

    def __init__(self):
        self.interrupter = interrupts.Remote()
        self._events: List[tuple] = []
        self._done: Optional[Dict[str, Any]] = None
        self._changed = threading.Condition()
        self._outcome: Optional[RunOutcome] = None
        self._partial_sent: Dict[Any, list] = {}  # origin -> its unended lines last sent

    def run(self, host, cell, sent, target, asked, pull, pull_from) -> None:
        """Run ``cell`` on ``target`` (this host's session, or a one-off run with the
        options ``asked``), as a request made here, with the names ``sent``."""
        notes: List[str] = []
        try:
            try:
                user_ns = names.unpack(sent) if sent else {}
            except Exception as exc:  # noqa: BLE001 - said as a replica would say it
                done = {"error": (type(exc).__name__, names.unloadable(
                            exc, f"on host {host}", "on every host", "")),
                        "traceback": traceback.format_exc(), "notes": notes}
            else:
                request = CellRequest(cell, user_ns=user_ns, pull=tuple(pull),
                                      pull_from=pull_from, announce=notes.append,
                                      hosted=self.interrupter, **asked)
                outcome = target.run(request, observer=self)
                done = {"outcome": _packed_outcome(outcome), "notes": notes}
        except BaseException as exc:  # noqa: BLE001 - the notebook says it, with the host
            done = {"error": (type(exc).__name__,
                              f"host {host}'s agent could not run the cell: {exc}"),
                    "traceback": traceback.format_exc(), "notes": notes}
        with self._changed:
            self._done = done
            self._changed.notify_all()

    def take(self, wait: float) -> Dict[str, Any]:
        with self._changed:
            if not self._events and self._done is None:
                self._changed.wait(wait)
            events, self._events = self._events, []
            events += self._partial_lines()
            reply: Dict[str, Any] = {"events": events, "done": self._done is not None}
            if self._done is not None:
                reply.update(self._done)
            return reply

    def _partial_lines(self) -> List[tuple]:
        """Events for the lines not yet ended (progress bars) the notebook shows as they
        grow: each replica's or process's that has some, or had some last time."""
        if self._outcome is None:
            return []
        logs = [*((o, r.log) for o, r in self._outcome.replicas.items()),
                *self._outcome.processes.items()]
        events = []
        for origin, log in logs:
            shown = log.partial()
            if shown or self._partial_sent.get(origin):
                events.append(("partial", origin, shown))
                self._partial_sent[origin] = shown
        return events

    def _add(self, *event) -> None:
        with self._changed:
            self._events.append(event)
            self._changed.notify_all()

    # -- the run's view ---------------------------------------------------------------

    def opened(self, outcome: RunOutcome) -> None:
        self._outcome = outcome

    def started(self, outcome: RunOutcome, ordinal: int) -> None:
        self._add("started", ordinal, outcome.replicas[ordinal].pid)

    def output(self, outcome: RunOutcome, origin, lines: List[str]) -> None:
        log = outcome.replica(origin).log if isinstance(origin, int) else outcome.process(origin)
        # The log has just taken these lines: their streams are its last entries.
        streams = [s for s, _ in itertools.islice(reversed(log.tail), len(lines))][::-1]
        streams = ["stdout"] * (len(lines) - len(streams)) + streams
        self._add("output", origin, list(zip(streams, lines)))

    def finished(self, outcome: RunOutcome, ordinal: int) -> None:
        self._add("finished", ordinal, _packed_replica(outcome.replicas[ordinal]))

    def stalled(self, outcome: RunOutcome, stall) -> None:
        self._add("stalled", None, stall)


def _packed_replica(rep) -> Dict[str, Any]:
    return {"state": rep.state, "pid": rep.pid, "elapsed": rep.elapsed,
            "has_value": rep.has_value, "value": rep.value, "value_repr": rep.value_repr,
            "error": rep.error, "last_rendezvous": rep.last_rendezvous,
            "pulled": dict(rep.pulled)}


def _packed_outcome(outcome: RunOutcome) -> Dict[str, Any]:
    """What the notebook uses of the host's outcome (the rest it keeps itself)."""
    return {"launch_error": outcome.launch_error, "session_ended": outcome.session_ended,
            "replicas": {o: _packed_replica(r) for o, r in outcome.replicas.items()}}
