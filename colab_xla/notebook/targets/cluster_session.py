"""Warm replicas on every host of a cluster (``%xla_session start`` while connected):
the notebook's side, and a target (:class:`ClusterSession`).

Each host's agent keeps a :class:`colab_xla.notebook.targets.session.Session` of its own
replicas (:meth:`colab_xla.notebook.cluster.agent.HostAgent.start_session`), and runs every
cell on it. The hosts are one program, so they start together and end together: a session
that could not start on one host, or ended on one (a replica died, an Interrupt not
honoured in time), ends on every host. The notebook keeps which of its names every host's
replicas have, and sends a name again only when the notebook changed it, as on one host
(:class:`colab_xla.notebook.targets.known_names.KnownNames`).

With ``--runtime jax`` the hosts' replicas are JAX processes of one ``jax.distributed``
job, which meet once, when the session starts, at host 0's coordinator
(:func:`colab_xla.notebook.targets.cluster_run.coordinator`); every cell then runs in them.
"""

from __future__ import annotations

import secrets
import time
from typing import Callable, Dict, List, Optional, Tuple, Union

from ... import runtimes
from ..cluster.connection import exception_line, host_note, import_ray
from ..outcome import RunObserver, RunOutcome
from ..request import CellRequest
from .cluster_run import HOSTS_OWN, run_on_hosts
from .session import START_TIMEOUT_SECONDS, SessionError
from .session_target import SessionTarget
from .target import Owned

# How long the hosts may take to start their replicas (each host's own limit, and a margin
# for the calls), and to end them before the notebook stops waiting.
START_SECONDS = START_TIMEOUT_SECONDS + 30
STOP_SECONDS = 10.0


class ClusterSession(SessionTarget):
    """Warm replicas on every host of ``cluster``. Make one with :meth:`start`. As a
    target, the replicas are the hosts' (as for :class:`ClusterOneOff
    <colab_xla.notebook.targets.cluster_one_off.ClusterOneOff>`) and the runtime the
    session's: a cell cannot ask another."""

    own_options = (HOSTS_OWN, Owned(("--runtime", "--devices-per-process"), (
        "{asked}: the session's replicas on the cluster were started with their own options "
        "({own}), which a cell cannot change. Add --fresh to run this cell on this machine, "
        "or %xla_session stop, then %xla_session start with the options you want."),
        SessionError))
    keeps_replicas = True

    def __init__(self, cluster, replicas: Dict[int, Dict[int, int]],
                 runtime: Union[runtimes.Runtime, str, None] = None,
                 devices_per_process: Optional[int] = None):
        super().__init__()  # (its last_failed: global ordinals)
        self.cluster = cluster
        self.runtime, self.devices_per_process = runtimes.get(runtime), devices_per_process
        self.replicas = replicas  # host -> {local ordinal: pid}

    @classmethod
    def start(cls, cluster, announce=print, runtime: Union[runtimes.Runtime, str, None] = None,
              devices_per_process: Optional[int] = None) -> "ClusterSession":
        """Start warm replicas on every host of ``cluster`` (in ``runtime``, a runtime or
        its name, None: the default; the JAX runtime's processes have
        ``devices_per_process`` devices each on CPU hosts) and wait until all are up; raise
        :class:`colab_xla.notebook.targets.session.SessionError` naming the host that could
        not (every host's are stopped then)."""
        began = time.monotonic()
        from ..launch import Launch
        from .cluster_run import host_request

        cluster.check_up()
        launch = Launch(runtime=runtime, devices_per_process=devices_per_process)
        launch.runtime.check_cluster(cluster.described, launch)
        ray = import_ray()
        session_id = "session-" + secrets.token_hex(6)
        request = host_request(cluster, launch)
        refs = [agent.start_session.remote(session_id, request) for agent in cluster.agents]
        ray.wait(refs, num_returns=len(refs), timeout=START_SECONDS)
        replicas: Dict[int, Dict[int, int]] = {}
        failures: List[str] = []
        for host, ref in enumerate(refs):
            try:
                reply = ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                failures.append(f"host {host}'s replicas did not start within "
                                f"{START_SECONDS:.0f} s")
                continue
            except Exception as exc:  # noqa: BLE001 - its agent or node is gone
                failures.append(f"host {host} is gone: {exception_line(exc)}")
                continue
            for note in reply.get("notes", ()):
                if announce:
                    announce(host_note(note, host))
            if "error" in reply:
                failures.append(f"host {host}: {reply['error'][1]}")
            else:
                replicas[host] = {int(i): pid for i, pid in reply["replicas"].items()}
        session = cls(cluster, replicas, launch.runtime, devices_per_process)
        session.start_seconds = time.monotonic() - began
        if failures:
            session.stop("it did not start on every host")
            raise SessionError("The session did not start on every host, so it was "
                               "stopped on all of them. " + "; ".join(failures) + ". A "
                               "one-off %%xla_spawn cell on the cluster shows how the "
                               "replicas fail on that host; %xla_cluster shows the hosts.")
        return session

    # -- a cell on every host's warm replicas (the target) ------------------------------

    def repeats(self, flag: str, request: CellRequest) -> bool:
        """A cell may repeat the session's runtime (not its devices per process)."""
        return flag == "--runtime" and runtimes.get(request.launch.runtime) == self.runtime

    def describe_own(self) -> str:
        return f"--runtime {self.runtime}"

    def run(self, request: CellRequest,
            observer: Optional[RunObserver] = None) -> RunOutcome:
        self.cluster.check_up()
        self.refuse(request)
        return run_on_hosts(self.cluster, request, observer, session=self)

    def debug(self, asked: Union[int, Tuple[int, int], None], ask: Callable[[str], str],
              show: Callable[[str], None]) -> str:
        """``%xla_debug`` on a host's replica: ``asked`` a global ordinal, ``(host, local
        ordinal)``, or None (the lowest that failed in the last cell); pdb runs there, its
        prompts relayed here (``ask``, ``show``); how it ended."""
        from .. import debugger

        self.cluster.check_up()
        if not self.up:
            raise debugger.DebugError(f"this cluster's session ended ({self.ended}).")
        # (host, local ordinal) of each replica, by global ordinal
        ordinals = [(h, i) for h in sorted(self.replicas) for i in sorted(self.replicas[h])]
        if isinstance(asked, tuple):
            if asked not in ordinals:
                raise debugger.DebugError(f"%xla_debug {asked[0]}:{asked[1]}: no such replica "
                                          "(HOST:R, R the replica's ordinal on its host; "
                                          "%xla_session shows them).")
            host, local = asked
        else:
            host, local = ordinals[debugger.chosen(asked, self.last_failed,
                                                   range(len(ordinals)))]
        ray = import_ray()
        agent = self.cluster.agents[host]
        # The agent answers within its own wait for the replica (Relayed.step): a host
        # that does not is gone or stuck, and the debugger ends (the session goes on).
        wait = debugger.ANSWER_SECONDS + 30

        def step(answer):
            try:
                return ray.get(agent.debug.remote(local, answer), timeout=wait)
            except Exception as exc:  # noqa: BLE001 - its agent or node is gone, or stuck
                return {"output": "", "prompt": None,
                        "ended": f"host {host} did not answer within {wait:g} s "
                                 f"({exception_line(exc)}); %xla_cluster shows whether it "
                                 "is still there"}

        show(debugger.opening(f"host {host} · replica {local} (replica "
                              f"{ordinals.index((host, local))})"))
        reply = step(None)
        while True:
            show(reply["output"])
            if reply["prompt"] is None:
                return reply["ended"] or f"host {host} did not answer"
            reply = step(ask(reply["prompt"]))

    # -- what a person sees -------------------------------------------------------------

    @property
    def replica_count(self) -> int:
        return sum(len(r) for r in self.replicas.values())

    @property
    def up(self) -> bool:
        return super().up and self.cluster.up

    def stop(self, reason: str = "stopped (%xla_session stop)") -> None:
        """End every host's session (each kills every process its session started)."""
        if self.ended is None:
            self.ended = reason
        if not self.cluster.up:
            return
        ray = import_ray()
        refs = [agent.stop_session.remote() for agent in self.cluster.agents]
        ray.wait(refs, num_returns=len(refs), timeout=STOP_SECONDS)

    def describe_start(self) -> str:
        """What ``%xla_session start`` says once every host's replicas are up."""
        return (f"colab_xla session: {self.replica_count} replicas started on "
                f"{len(self.cluster.hosts)} hosts in {self.start_seconds or 0:.1f} s.")

    def describe(self) -> str:
        """``%xla_session``'s status text: the session, then each host's replicas."""
        if not self.up:
            return f"colab_xla session: ended ({self.ended or self.cluster.ended})."
        ray = import_ray()
        uptime = time.time() - self.started_at
        are = self.runtime.replicas_are
        lines = [f"colab_xla session: up {uptime:.0f} s on the cluster, "
                 f"{self.replica_count} replicas{f' ({are})' if are else ''} on "
                 f"{len(self.replicas)} hosts, {self.cells_run} cell"
                 f"{'s' if self.cells_run != 1 else ''} run."]
        refs = [agent.session_status.remote() for agent in self.cluster.agents]
        for host, ref in enumerate(refs):
            try:
                text = ray.get(ref, timeout=STOP_SECONDS) or "no session"
            except Exception as exc:  # noqa: BLE001 - said, not raised: a status line
                text = f"no answer ({exception_line(exc)})"
            body = text.splitlines()[1:] or [text]
            lines.append(f"  host {host}:")
            lines += ["  " + line for line in body]
        return "\n".join(lines)
