"""Where a cell runs: a *target* (:class:`~colab_xla.notebook.targets.target.Target`), and the
targets this notebook process keeps. IPython-free: the magics are glue over this.

* :func:`current`: the one place that decides where a ``%%xla_spawn`` cell runs: the
  cluster's session, the cluster, this machine's session, or a one-off run;
* :func:`run_cell` (:mod:`.one_off`'s): a cell from keywords, on replicas of its own or
  on a given session (scripts, tests, benchmarks);
* this notebook's session (``%xla_session``: :func:`current_session`,
  :func:`start_asked_session`, :func:`stop_session`; this machine's: :func:`local_session`,
  :func:`start_session`) and its cluster connection (``%xla_cluster``:
  :func:`connected_cluster`, :func:`connect_cluster`, :func:`stop_cluster`).

Example (in a plain Python process with torch_xla installed)::

    >>> outcome = run_cell("print('hi from', index)\\nindex * 10", replicas=2)
    >>> outcome.results()
    {0: 0, 1: 10}
"""

from __future__ import annotations

from typing import Mapping, Optional

from .. import cluster
from ...errors import OptionError
from ..defaults import Defaults
from ..request import SessionRequest
from .cluster_one_off import ClusterOneOff
from .cluster_run import HOSTS_OWN
from .cluster_session import ClusterSession
from .one_off import OneOff, run_cell
from .session import Session, SessionError, SessionOptions, new_session
from .session_target import SessionTarget
from .target import Target

__all__ = ["Target", "SessionTarget", "current", "run_cell", "current_session", "local_session",
           "start_session", "start_asked_session", "stop_session", "connected_cluster",
           "connect_cluster", "stop_cluster"]

_session: Optional[Session] = None  # this machine's session, up or ended (None: none started)


def current(fresh: bool = False) -> Target:
    """Where a ``%%xla_spawn`` cell runs now: while a cluster is connected, on its session
    if one is up there, else on every host; else on this machine's session, up or ended
    (an ended one refuses the cell, saying why); else, and always with ``fresh``
    (``--fresh``), a one-off run on this machine."""
    if not fresh:
        connected = cluster.current()
        if connected is not None:
            warm = connected.session
            return warm if warm is not None and warm.up else ClusterOneOff(connected)
        if _session is not None:
            return _session
    return OneOff()


# -- this notebook's session (%xla_session) --------------------------------------------------


def current_session() -> Optional[SessionTarget]:
    """The notebook's session, up or ended: while a cluster is connected its hosts' (a
    :class:`ClusterSession`), else this machine's (a :class:`Session`); None if none was
    started. Either is a :class:`SessionTarget`: the magics use only its verbs."""
    connected = cluster.current()
    return connected.session if connected is not None else _session


def local_session() -> Optional[Session]:
    """This machine's session, up or ended (None if none was started)."""
    return _session


def start_session(opts: SessionOptions, user_ns: Mapping, announce=print,
                  defaults: Optional[Defaults] = None) -> Session:
    """Start this machine's session with ``opts`` (the one ``%%xla_spawn`` cells run on,
    :func:`current`), unless one is up (a :class:`SessionError`)."""
    global _session
    _check_none_up()
    started = new_session(opts, user_ns, announce, defaults)
    _check_none_up()
    _session = started
    return started


def start_asked_session(request: SessionRequest, user_ns: Mapping, restart: bool = False,
                        announce=print) -> SessionTarget:
    """``%xla_session start`` (``restart``: restart) as ``request`` asks: on every host
    while a cluster is connected (which takes only ``--runtime`` and
    ``--devices-per-process``), else on this machine. ``restart`` starts the notebook's
    session again with the options it was started with."""
    connected = cluster.current()
    if restart and current_session() is None:
        raise SessionError("%xla_session restart: no session was started "
                           "(%xla_session start starts one).")
    if connected is not None:
        return _start_on_cluster(connected, request, restart, announce)
    if restart:
        opts = _session.options
        stop_session()
    else:
        opts = SessionOptions.asked(request)
    return start_session(opts, user_ns, announce, request.defaults)


def _start_on_cluster(connected, request: SessionRequest, restart: bool,
                      announce) -> ClusterSession:
    given = HOSTS_OWN.among(request.given())  # (the hosts' own; the rest their session's)
    if given:
        raise SessionError(f"{', '.join(given)}: on a cluster, each host's replicas are "
                           "the ones %xla_cluster planned (-n per CPU host; a TPU host's "
                           "chips), so %xla_session start takes only --runtime (and "
                           "--devices-per-process) there.")
    warm = connected.session
    runtime, per_process = request.runtime, request.devices_per_process
    if restart:  # the same options
        runtime, per_process = warm.runtime, warm.devices_per_process
    if warm is not None and warm.up:
        if not restart:
            raise SessionError("a session is up on the cluster: %xla_session restart "
                               "starts it again, %xla_session stop ends it.")
        warm.stop()
    connected.session = None
    connected.session = ClusterSession.start(connected, announce=announce, runtime=runtime,
                                             devices_per_process=per_process)
    return connected.session


def stop_session() -> Optional[SessionTarget]:
    """Stop the notebook's session (every process it started), if one is up; return it
    (None if none was started)."""
    global _session
    connected = cluster.current()
    if connected is not None:
        stopped, connected.session = connected.session, None
    else:
        stopped, _session = _session, None
    if stopped is not None and stopped.up:
        stopped.stop()
    return stopped


def _check_none_up() -> None:
    """Refuse a second session while one is up."""
    if _session is not None and _session.up:
        raise SessionError("A session is already up: %xla_session stop ends it, "
                           "%xla_session restart starts it again.")


# -- this notebook's cluster (%xla_cluster) --------------------------------------------------


def connected_cluster() -> Optional[cluster.Cluster]:
    """The notebook's cluster connection, while it is up."""
    return cluster.current()


def connect_cluster(address: Optional[str] = "auto", *, hosts: Optional[int] = None,
                    replicas: Optional[int] = None, slice_name: Optional[str] = None,
                    slices: Optional[int] = None, local: bool = False,
                    announce=print) -> cluster.Cluster:
    """Connect this notebook to a cluster (``local``: of ``hosts`` CPU hosts started on this
    machine), whose hosts then run every cell; refused while this machine has a session."""
    if _session is not None:
        raise SessionError("a session is up on this machine (%xla_session): stop it first "
                           "(%xla_session stop).")
    if local:
        if hosts is None or replicas is None:
            raise OptionError("%xla_cluster local needs --hosts H and -n N (replicas per "
                              "host), e.g. %xla_cluster local --hosts 2 -n 2.")
        return cluster.start_local(hosts, replicas, slices, announce=announce)
    return cluster.connect(address, hosts=hosts, replicas=replicas, slice_name=slice_name,
                           slices=slices, announce=announce)


def stop_cluster() -> Optional[cluster.Cluster]:
    """End the notebook's cluster connection (its session, agents, local cluster); return
    it, up or ended before (None if none was connected)."""
    return cluster.stop()
