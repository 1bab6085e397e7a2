"""A cell on every replica of every host of a cluster, from the notebook's side:
:func:`run_on_hosts`, which both cluster targets run their cells through (the one-off
:class:`~colab_xla.notebook.targets.cluster_one_off.ClusterOneOff`, each host's replicas
started for the cell, and a cluster's session,
:class:`~colab_xla.notebook.targets.cluster_session.ClusterSession`, on its warm ones).

Each host's agent runs the cell on its replicas (:mod:`colab_xla.notebook.cluster.agent`); this
module starts it on every host, collects their events (Ray calls that wait for news,
one per host at a time), and makes them one :class:`~colab_xla.notebook.outcome.RunOutcome` with
global ordinals (host ``h``'s replica ``i`` is ``h * per_host + i``), drawn by the same
views as a one-off run. Values and ``--pull`` names arrive packed and are loaded here,
where the notebook's classes are.

With ``--runtime jax``, every host runs the cell as JAX processes (on a CPU host one per
replica, on a TPU host one driving its chips), all of one ``jax.distributed`` job:
host 0's agent picks the coordinator's port, every host is told it, and each process's id
is its global ordinal (the runtime says how many replicas each host runs and what every
host's replicas get: :meth:`colab_xla.runtimes.Runtime.cluster_environ`).

The run is cut, on every host at once, on Interrupt, ``--timeout``, a host that is gone
(its agent or node), or :data:`colab_xla.notebook.deadlines.FAIL_FAST_SECONDS` after a replica
failed on any host (the deadlines and the reason a local run has:
:class:`colab_xla.notebook.deadlines.Deadlines`): each agent stops its replicas as the
notebook stops a local run's, and a host that does not answer within
:data:`HOST_GRACE_SECONDS` is taken as gone.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from typing import Any, Dict, List, Optional, Tuple

from .. import interrupts, options, preflight, state
from ... import runtimes
from ...wire.cell import Cell
from ...errors import OptionError
from ..launch import Launch
from ..outcome import DONE, FAILED, STOPPED, RunObserver, RunOutcome, Stall, load_results
from ...wire.reports import ReplicaError
from ..deadlines import Deadlines
from ..draw_pacing import TICK_SECONDS
from ...wire import names
from ..cluster.connection import Cluster, exception_line, host_note, import_ray
from ..cluster.hosts import ClusterError
from ..request import CellRequest

# How long a poll waits in the agent for news: the notebook's Interrupt is seen between polls.
POLL_SECONDS = 0.1
# After the run was cut, how long a host may take to stop its replicas and answer.
HOST_GRACE_SECONDS = 10.0


# What a cell on the cluster cannot ask: each host's replicas are the ones %xla_cluster
# started there.
HOST_OPTIONS = ("-n", "--start-method", "--launcher", "--debug-single", "--env", "--cache",
                "--simulate")


def refuse_host_options(request: CellRequest) -> None:
    """Refuse a cell on the cluster that asks for replicas of its own."""
    asked = [flag for flag in request.replica_flags_asked() if flag in HOST_OPTIONS]
    if asked:
        raise OptionError(f"{', '.join(asked)}: a cell on the cluster runs on the replicas "
                          "%xla_cluster started on each host. Give the replicas per host "
                          "to %xla_cluster (-n); or add --fresh to run this cell on this "
                          "machine instead.")


def run_on_hosts(cluster: Cluster, request: CellRequest, observer: Optional[RunObserver] = None,
                 session=None) -> RunOutcome:
    """The cell of ``request`` on every host of ``cluster``: on replicas each host's agent
    starts for it, or those of ``session`` (a
    :class:`~colab_xla.notebook.targets.cluster_session.ClusterSession`, up)."""
    runtime = session.runtime if session is not None else request.launch.runtime
    launch = Launch(runtime=runtime, devices_per_process=request.launch.devices_per_process)
    options.check_run(replicas=None, timeout=request.timeout, env={}, pull=request.pull,
                      pull_from=request.pull_from, cache_dir=None, launch=launch)
    launch.runtime.check_cluster(cluster.described, launch)
    per_host = replicas_per_host(cluster, launch.runtime)
    options.check_pull_from(request.pull_from, sum(per_host))
    cell, user_ns = request.cell, request.user_ns
    cell.check()  # an empty cell or a SyntaxError is said here, with its line, not per host
    for problem in preflight.cell_problems(cell):
        raise preflight.refusal(problem)
    if session is not None:  # the names every host's warm replicas do not have yet
        sent, sent_names = session.known.pack(cell, user_ns)
    else:  # without fork between them, the notebook's names travel by value (as for spawn)
        sent = names.pack(names.used_names(cell, user_ns), user_ns, "spawn")
    # (a session's replicas are its own: they met when it started)
    host_launch = {} if session is not None else host_request(cluster, launch)
    host_launch["stall"] = request.stall  # (each host's replicas said where they are)
    layout = [(h, i) for h, count in enumerate(per_host) for i in range(count)]
    chosen = (None if request.targets is None  # (a one-off run refused it: only a session)
              else [layout[o] for o in request.targets.ordinals(layout)])
    run = _ClusterRun(cluster, per_host, user_ns, observer or RunObserver(), request.timeout,
                      request.announce, chosen, began=request.began)
    cluster.cells_run += 1
    outcome = run.run(cell, sent, request.pull, request.pull_from, host_launch)
    if session is not None:
        session.cells_run += 1
        session.last_failed = outcome.failed
        session.known.sent(sent_names, user_ns)
        if run.session_ended:  # one host's session ended: the hosts are one program
            host, why = sorted(run.session_ended.items())[0]
            session.stop(f"on host {host}, {why}")
        if not session.up:
            outcome.session_ended = session.ended
    if not cluster.up:
        outcome.cluster_ended = cluster.ended
    return outcome


def replicas_per_host(cluster: Cluster, runtime: runtimes.Runtime) -> List[int]:
    """How many replicas each host runs in ``runtime``: what %xla_cluster planned, or
    what the runtime makes of it (JAX: one process on a TPU host, driving every chip)."""
    return [runtime.cluster_replicas(d) for d in cluster.described]


def host_request(cluster: Cluster, launch: Launch) -> Dict[str, Any]:
    """What every host's agent is told for a run (or session) of ``launch``'s runtime
    (:meth:`colab_xla.notebook.cluster.agent.HostAgent.start`): the runtime by name, its
    devices per process, and the variables every host's replicas get."""
    return {"runtime": launch.runtime.name, "devices_per_process": launch.devices_per_process,
            "environ": launch.runtime.cluster_environ(
                cluster.described, lambda: coordinator(cluster))}


def coordinator(cluster: Cluster) -> str:
    """Where a job's processes on every host meet: host 0's address, a port its agent
    found free (process 0 listens there alone, not on every interface)."""
    ray = import_ray()
    try:
        return ray.get(cluster.agents[0].coordinator.remote(), timeout=HOST_GRACE_SECONDS)
    except Exception as exc:  # noqa: BLE001 - its agent or node is gone, or it is stuck
        raise ClusterError(f"host 0 gave no port for the JAX processes' coordinator: "
                           f"{exception_line(exc)}. %xla_cluster shows the hosts.") from None


class _ClusterRun:
    def __init__(self, cluster: Cluster, per_host: List[int], user_ns, observer: RunObserver,
                 timeout: Optional[float], announce,
                 chosen: Optional[List[Tuple[int, int]]] = None,
                 began: Optional[float] = None):
        self.cluster, self.user_ns, self.observer = cluster, user_ns, observer
        self.timeout, self.announce = timeout, announce
        self.run_id = secrets.token_hex(8)
        self.per_host = per_host
        self.offsets = [sum(self.per_host[:h]) for h in range(len(self.per_host))]
        # The replicas that run the cell, by host (--targets); a host with none sits it out.
        self.chosen: Dict[int, List[int]] = {
            h: [i for host, i in chosen if host == h] if chosen is not None else list(range(n))
            for h, n in enumerate(self.per_host)}
        self.outcome = RunOutcome(device_type=cluster.described[0]["device"],
                                  log_dir=state.new_log_dir())
        if began is not None:  # (the cell's start: the run's time counts from there)
            self.outcome.began = began
        if chosen is not None:
            self.outcome.idle = sorted(set(range(sum(per_host))) - {
                self.offsets[h] + i for h, i in chosen})
        # The run's deadlines and why it was cut (the policy of a local run's Supervisor).
        self._deadlines: Optional[Deadlines] = None  # made by run
        self._gone: Dict[int, str] = {}  # host -> how it went
        self.session_ended: Dict[int, str] = {}  # host -> why its session ended in the cell
        self._stalls: Dict[int, Stall] = {}  # host -> where its quiet replicas are

    def run(self, cell: Cell, sent: Optional[bytes], pull, pull_from,
            host_launch: Optional[Dict[str, Any]]) -> RunOutcome:
        ray = import_ray()
        started = time.monotonic()
        self._deadlines = deadlines = Deadlines(self.timeout, started)
        for host, locals_ in self.chosen.items():
            for local in locals_:
                self.outcome.hosts[self.offsets[host] + local] = host
                self.outcome.replica(self.offsets[host] + local)
        with interrupts.held() as held:
            self.observer.opened(self.outcome)
            pending: Dict[Any, int] = {}
            for host, agent in enumerate(self.cluster.agents):
                if not self.chosen[host]:
                    continue
                host_pull, host_from = self._pull_for(host, pull, pull_from)
                asked = host_launch
                if len(self.chosen[host]) < self.per_host[host]:  # by index on the host
                    asked = dict(host_launch, targets=",".join(map(str, self.chosen[host])))
                agent.start.remote(self.run_id, cell, sent, host_pull, host_from, asked)
                pending[agent.poll.remote(self.run_id, POLL_SECONDS)] = host
            next_tick, cut_at = time.monotonic() + TICK_SECONDS, None
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
                for ref in ready:
                    host = pending.pop(ref)
                    if self._take(ray, ref, host):
                        agent = self.cluster.agents[host]
                        pending[agent.poll.remote(self.run_id, POLL_SECONDS)] = host
                now = time.monotonic()
                if deadlines.stop is None:
                    reason = "interrupted" if held.requested else deadlines.passed(now)
                    if held.requested:
                        self.outcome.interrupted = True
                    if reason:
                        self._cut(reason, pending)
                        cut_at = now
                elif now - cut_at > HOST_GRACE_SECONDS:
                    for ref, host in pending.items():
                        self._host_gone(host, f"it did not stop within {HOST_GRACE_SECONDS:g}"
                                              " s of the notebook's stop")
                        ray.cancel(ref)
                    pending.clear()
                if now >= next_tick:
                    self.observer.tick(self.outcome)
                    next_tick = now + TICK_SECONDS
        self._settle()
        if self._gone:  # the hosts are no longer one group: the connection ends
            host, why = next(iter(sorted(self._gone.items())))
            self.cluster.stop(f"host {host} is gone: {why}")
        self.outcome.elapsed = time.monotonic() - self.outcome.began
        for log in [*(r.log for r in self.outcome.replicas.values()),
                    *self.outcome.processes.values()]:
            log.finish()  # (every line arrived whole: this closes the log files)
        return self.outcome

    # -- what a host says -------------------------------------------------------------------

    def _take(self, ray, ref, host: int) -> bool:
        """Apply one poll's reply; True while the host's run goes on."""
        try:
            reply = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            self._host_gone(host, exception_line(exc))
            return False
        for event in reply["events"]:
            kind, origin = event[0], event[1]
            if kind == "started":
                rep = self.outcome.replica(self._global(host, origin))
                rep.pid = event[2]
                self.observer.started(self.outcome, rep.ordinal)
            elif kind == "output":
                self._output(host, origin, event[2])
            elif kind == "partial":
                self._log(host, origin)[1].show_partial(event[2])
            elif kind == "finished":
                self._finished(self._global(host, origin), event[2])
            elif kind == "stalled":
                self._stalled(host, event[2])
        if not reply["done"]:
            return True
        for note in reply.get("notes", ()):
            if self.announce:
                self.announce(host_note(note, host))
        if "error" in reply:  # the agent could not run the cell at all (it is still up)
            ename, message = reply["error"]
            self._fail_host(host, ReplicaError("exception", ename, message, reply["traceback"]))
        else:
            for ordinal, packed in reply["outcome"]["replicas"].items():
                rep = self.outcome.replica(self._global(host, ordinal))
                if rep.state not in (DONE, FAILED, STOPPED) and packed["state"] != "running":
                    self._finished(rep.ordinal, packed)
            if reply["outcome"]["session_ended"]:
                self.session_ended[host] = reply["outcome"]["session_ended"]
            launch_error = reply["outcome"]["launch_error"]
            if launch_error is not None and self.outcome.launch_error is None:
                self.outcome.launch_error = ReplicaError(
                    launch_error.kind, launch_error.ename,
                    f"host {host}: {launch_error.evalue}", launch_error.traceback)
        return False

    def _global(self, host: int, local: int) -> int:
        return self.offsets[host] + local

    def _log(self, host: int, origin):
        """The notebook's name and log of a host's replica (by local ordinal) or process."""
        if isinstance(origin, int):
            origin = self._global(host, origin)
            return origin, self.outcome.replica(origin).log
        origin = f"host {host} · {origin}"
        return origin, self.outcome.process(origin)

    def _output(self, host: int, origin, lines: List) -> None:
        origin, log = self._log(host, origin)
        log.show_partial([])  # (these lines end what it showed unended; the host says more)
        for stream, run in itertools.groupby(lines, key=lambda pair: pair[0]):
            done = log.write(stream, "".join(line + "\n" for _, line in run))
            self.observer.output(self.outcome, origin, done)

    def _finished(self, ordinal: int, packed: Dict[str, Any]) -> None:
        rep = self.outcome.replica(ordinal)
        rep.pid = packed["pid"] or rep.pid
        rep.elapsed, rep.value_repr = packed["elapsed"], packed["value_repr"]
        rep.error, rep.last_rendezvous = packed["error"], packed["last_rendezvous"]
        if packed["state"] == STOPPED:  # stopped by its host: said again when settled
            rep.state = STOPPED
            return
        load_results(rep, packed["value"] if packed["has_value"] else None,
                            packed["pulled"], self.user_ns)
        rep.state = FAILED if rep.error else DONE
        if rep.state == FAILED:
            self._deadlines.failed(ordinal, time.monotonic())
        self.observer.finished(self.outcome, ordinal)

    def _stalled(self, host: int, stall: Optional[Stall]) -> None:
        """Host ``host``'s replicas have been quiet (``stall``, by local ordinal; None:
        output again): the view is told where every quiet host's replicas are."""
        if stall is None:
            self._stalls.pop(host, None)
        else:
            self._stalls[host] = Stall(stall.quiet, {self._global(host, o): place
                                                     for o, place in stall.places.items()})
        quiet = list(self._stalls.values())
        self.observer.stalled(self.outcome, Stall(
            min(s.quiet for s in quiet), {o: p for s in quiet for o, p in s.places.items()})
            if quiet else None)

    def _host_gone(self, host: int, why: str) -> None:
        """Host ``host`` is gone: its replicas still running failed with it."""
        self._gone[host] = why
        self._fail_host(host, ReplicaError(
            "died", "HostDied", f"host {host} ({self.cluster.hosts[host].address}) is gone: "
                                f"{why}"))

    def _fail_host(self, host: int, error: ReplicaError) -> None:
        """The replicas of ``host`` that have not ended failed with ``error``."""
        for local in self.chosen[host]:
            rep = self.outcome.replica(self._global(host, local))
            if rep.state in (DONE, FAILED, STOPPED):
                continue
            rep.state, rep.error = FAILED, error
            self._deadlines.failed(rep.ordinal, time.monotonic())
            self.observer.finished(self.outcome, rep.ordinal)

    def _cut(self, reason: str, pending: Dict[Any, int]) -> None:
        self._deadlines.stop = reason
        for host in set(pending.values()):
            self.cluster.agents[host].interrupt.remote(self.run_id)

    def _settle(self) -> None:
        """Replicas a stop reached: said as for a local run, with global ordinals."""
        deadlines = self._deadlines
        if deadlines.stop is None:  # not cut here: the hosts stopped them (their own policy)
            deadlines.stop = ("failed" if deadlines.first_failed in self.outcome.replicas
                              else "interrupted")
        for rep in self.outcome.replicas.values():
            if rep.state not in (DONE, FAILED):
                rep.state = STOPPED
                # (where it was: its host took its stack as it stopped it)
                place = rep.error.place if rep.error is not None else ""
                rep.error = dataclasses.replace(deadlines.stopped(rep, self.outcome.replicas),
                                                place=place)
        self.outcome.replicas = dict(sorted(self.outcome.replicas.items()))

    def _pull_for(self, host: int, pull, pull_from):
        if pull_from is None:
            return list(pull), None
        local = pull_from - self.offsets[host]
        if 0 <= local < self.per_host[host]:
            return list(pull), local
        return [], None
