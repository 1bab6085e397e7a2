"""The JAX runtime (``%%xla_spawn --runtime jax``): the cell runs in N JAX processes with
``jax.distributed`` initialized before it starts, so ``jax.process_index()``,
``jax.process_count()``, the global ``jax.devices()`` and collectives across processes
work, and torchax (PyTorch tensors backed by JAX arrays) works on top.

Both halves of the runtime live here (:class:`Jax`), IPython-free:

* the notebook's: :func:`plan` (the processes and their environment: on CPU one device
  each, or ``devices_per_process`` through XLA's host platform device count; on a TPU host
  one process driving its chips) and :func:`backend_problem`, the guard that refuses a run
  when the notebook's own process started a JAX backend (its replicas fork from it);
* the replica's: :func:`join` (where the processes meet, kept when the process starts),
  :func:`initialize` (``jax.distributed.initialize`` with the coordinator the launcher
  chose and this process's id, once per process), :func:`leave` and :func:`to_host`,
  which makes a value the notebook can load (JAX arrays and torchax tensors arrive as
  NumPy arrays and CPU torch tensors; a global array no process holds whole is refused
  with the gather to use).

On CPU, JAX's default collectives between processes are gloo's: this simulates the
program, not a pod's interconnect. The launcher (:mod:`colab_xla.notebook.launch`) starts the
processes as for the CPU simulation, one ``multiprocessing`` process each, and gives them
a coordinator address of the run's own (:data:`COORDINATOR`). On a cluster
(:mod:`colab_xla.notebook.cluster`), every host's agent starts its processes the same way, and
all of them are one job: the coordinator is on host 0 (its agent picks the port), given
to every host in :data:`COORDINATOR`.

What listens, and where: JAX's coordination service has no authentication (whoever reaches
it can set the keys the processes read, or end the job by connecting as one of its
processes), so on one host it is a Unix socket in the run's private directory, which only
this user can enter (:func:`coordinator_address`); on a cluster it listens on host 0's own
address, never every interface. gloo's connections between the processes listen on
127.0.0.1 on one host and on the host's own address on a cluster (:func:`initialize`).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..errors import OptionError, Problem, SetupError
from ..wire.host_rank import HostRank
from .base import VARIABLE, Runtime, refuse_xmp_launch
from .plan import Hardware, ReplicaCountError, ReplicaPlan

# Where a run's processes meet (set by the launcher per run, or by a cluster's notebook).
COORDINATOR = "COLAB_XLA_JAX_COORDINATOR"
# How long a process waits for the others to reach jax.distributed.initialize, and how
# long a lost peer takes to be noticed (JAX's defaults: 300 s and 100 s).
INITIALIZATION_TIMEOUT = 120
HEARTBEAT_TIMEOUT = 10
# More processes than this on CPU only slow the machine down (each is an interpreter).
MAX_CPU_PROCESSES = 16

# The coordinator's Unix socket, in the run's private directory (one host).
SOCKET_NAME = "jax-coordinator"
# JAX's own variable for where the coordinator listens: set by the user, it is kept.
BIND_VARIABLE = "JAX_COORDINATOR_BIND_ADDRESS"

# The code of the preflight problem a JAX backend in the notebook's process is.
BACKEND_STARTED = "jax-backend-initialized"
# Calls that start a JAX backend in the process that makes them.
STARTING_CALLS = re.compile(
    r"(jax\.(?:local_)?devices\(|jax\.device_put\(|jax\.jit\(|jax\.random\.\w+\(|"
    r"(?:jnp|jax\.numpy)\.\w+\(|jax\.process_index\(|jax\.device_count\()")

JAX_INSTALL_HINT = ("pip install 'jax[cpu]' for CPU processes (Colab's TPU runtime ships jax "
                    "with libtpu), then restart the kernel.")


# -- the notebook's side ------------------------------------------------------------------

def plan(requested: Optional[int], hw: Hardware, devices_per_process: Optional[int],
         environ: Mapping[str, str]) -> ReplicaPlan:
    """The :class:`colab_xla.runtimes.plan.ReplicaPlan` of a JAX run: one process per replica
    (``index`` is the process index), with the variables JAX reads before its backend
    starts. ``hw`` is :func:`colab_xla.notebook.hardware.detect`'s."""
    if requested is not None and requested < 1:
        raise ReplicaCountError(f"-n {requested}: the number of JAX processes must be 1 or "
                                "more.")
    if devices_per_process is not None and devices_per_process < 1:
        raise ReplicaCountError(f"--devices-per-process {devices_per_process}: give 1 or more.")
    env: dict = {VARIABLE: RUNTIME.name}
    if hw.device == "TPU":
        if requested not in (None, 1) or devices_per_process is not None:
            raise ReplicaCountError(
                "on a TPU host the JAX runtime runs one process driving every chip of the host "
                "(jax.local_devices() are its chips): leave -n and --devices-per-process out. "
                "On a pod slice, %xla_cluster runs one process per host.")
        return ReplicaPlan("TPU", 1, env, processes=1, runtime=RUNTIME)
    n = requested or 2
    if n > MAX_CPU_PROCESSES:
        raise ReplicaCountError(f"-n {n}: at most {MAX_CPU_PROCESSES} JAX processes on CPU "
                                "(each is an interpreter of its own); use fewer processes, "
                                "and --devices-per-process for more devices.")
    per_process = devices_per_process or 1
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS=host_device_flags(environ.get("XLA_FLAGS", ""), per_process))
    note = (f"colab_xla: JAX runtime, {n} process{'es' if n != 1 else ''} on CPU with "
            f"{per_process} device{'s' if per_process != 1 else ''} each (jax.distributed; "
            "gloo between processes).")
    return ReplicaPlan("CPU", n, env, note, processes=n, runtime=RUNTIME)


def coordinator_address(free_port: Callable[[], int],
                        unix_socket: Optional[Callable[[str], Optional[str]]]) -> str:
    """Where one host's processes of a run meet: a Unix socket in the run's private
    directory (``unix_socket(name)``: its path there, None where the path would be too long
    for a Unix socket), which no other user can reach; else 127.0.0.1 and a port free now
    (``free_port()``): loopback only, but any local user can connect to it."""
    path = unix_socket(SOCKET_NAME) if unix_socket is not None else None
    return f"unix:{path}" if path else f"127.0.0.1:{free_port()}"


def host_device_flags(flags: str, count: int) -> str:
    """``XLA_FLAGS`` with the host platform's device count set to ``count``."""
    kept = re.sub(r"--xla_force_host_platform_device_count=\S*", "", flags).split()
    return " ".join([*kept, f"--xla_force_host_platform_device_count={count}"])


def backend_problem() -> Optional[Problem]:
    """A :class:`colab_xla.errors.Problem` if this process (the notebook's) has started
    a JAX backend, else None. Replicas fork from it, and a forked JAX backend is not
    usable (its threads did not come along)."""
    if "jax" not in sys.modules:
        return None
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        return None
    return Problem(
        BACKEND_STARTED,
        "JAX has started a backend in this notebook's own process (a call such as "
        "jax.devices(), jnp.array(...) or a jitted function ran outside %%xla_spawn), so JAX "
        "processes cannot start from it: the processes it forks would share a backend that "
        "does not work there, and jax.distributed must run before any backend starts.",
        "restart the kernel, then use JAX only inside %%xla_spawn --runtime jax cells (or "
        "import jax in the notebook without calling it).")


def check_installed() -> None:
    """Refuse the JAX runtime where jax is not installed (SetupError, with the install)."""
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        raise SetupError("--runtime jax needs JAX, which is not installed in this "
                         f"environment: {JAX_INSTALL_HINT}")


# -- the replica's side ---------------------------------------------------------------------

# (coordinator, processes, process id, the address gloo listens on)
_membership: Optional[Tuple[str, int, int, str]] = None
_initialized = False


def join(environ: Mapping[str, str] = os.environ) -> None:
    """In a new replica process: keep where its JAX processes meet and its process id,
    as the launcher set them (a session's later cells bring an environment without
    them). On a cluster's host (:class:`colab_xla.wire.host_rank.HostRank` in the
    environment), the processes are every host's, the id is the global ordinal, and gloo
    listens on the host's address (on one host, on 127.0.0.1)."""
    global _membership
    count = int(environ.get("PJRT_LOCAL_PROCESS_COUNT", "1"))
    process_id = int(environ.get("PJRT_LOCAL_PROCESS_RANK", "0"))
    address = "127.0.0.1"
    rank = HostRank.from_environ(environ)
    if rank is not None:
        count, process_id, address = rank.world, rank.index(process_id), rank.address
    _membership = (environ[COORDINATOR], count, process_id, address)


def initialize() -> None:
    """``jax.distributed.initialize`` for this process, once (before its first cell),
    with the run's coordinator and this process's id (:func:`join`).

    Process 0's coordination service listens at the coordinator's address itself (JAX's
    default is every interface, ``[::]``), unless the user set JAX's own
    :data:`BIND_VARIABLE`; gloo's listens on the address :func:`join` kept."""
    global _initialized
    if _initialized:
        return
    import jax

    coordinator, processes, process_id, address = _membership
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=processes, process_id=process_id,
        coordinator_bind_address=None if os.environ.get(BIND_VARIABLE) else coordinator,
        cluster_detection_method="deactivate",  # (on a TPU VM it would ask the metadata)
        initialization_timeout=INITIALIZATION_TIMEOUT,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT)
    gloo_listens_on(address)
    _initialized = True


def gloo_listens_on(address: str) -> None:
    """Make the CPU backend's gloo collectives (JAX's between processes, when it starts)
    listen on ``address``: JAX gives gloo no address, and gloo binds the one the machine's
    hostname resolves to, which on a cloud VM is its network address. The CPU backend's
    factory is replaced by one that passes it (JAX's ``make_cpu_client(collectives=...)``);
    with ``jax_cpu_collectives_implementation`` other than gloo, or a jax without these
    (private) names, JAX's own default stays."""
    import jax

    try:
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax
    except ImportError:
        return
    register = getattr(xla_bridge, "register_backend_factory", None)
    make_cpu_client = getattr(xla_bridge, "make_cpu_client", None)
    make_gloo = getattr(_jax, "make_gloo_tcp_collectives", None)
    if None in (register, make_cpu_client, make_gloo):
        return

    def cpu_client():
        client = distributed.global_state.client
        if client is None or jax.config.jax_cpu_collectives_implementation != "gloo":
            return make_cpu_client()
        return make_cpu_client(collectives=make_gloo(distributed_client=client,
                                                     hostname=address))

    register("cpu", cpu_client, priority=0, fail_quietly=False)  # (as JAX registers it)


def leave() -> None:
    """At the end of a JAX process: wait until every process of the run is there
    (``jax.distributed.shutdown``). Process 0 serves the others' coordination, and its
    end would end any still running (a fatal "JAX distributed service" error)."""
    if _initialized:
        import jax

        jax.distributed.shutdown()


def first_device():
    """The cell's ``device``: this process's first local device."""
    import jax

    return jax.local_devices()[0]


def to_host(value: Any) -> Any:
    """``value`` with its JAX arrays as NumPy arrays and torchax tensors as CPU torch
    tensors (in lists, tuples and dicts too), so that the notebook, which has no backend,
    can load it. A global array that this process does not hold whole raises ValueError
    naming the gather to use."""
    if type(value) is dict:
        return {k: to_host(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(to_host(v) for v in value)
    jax = sys.modules.get("jax")
    if jax is None:
        return value
    if _is_torchax(value):
        import torch

        return torch.from_numpy(_numpy(value.jax()).copy())
    if isinstance(value, jax.Array):
        return _numpy(value)
    return value


def _numpy(array):
    import numpy as np

    if array.is_fully_addressable:
        return np.asarray(array)
    if array.is_fully_replicated:  # every process holds it whole: this one's copy
        return np.asarray(array.addressable_data(0))
    raise ValueError(
        f"a global jax.Array of shape {tuple(array.shape)} that this process does not hold "
        "whole (it spans processes) cannot be returned from one process: return "
        "jax.experimental.multihost_utils.process_allgather(x) for the whole array, or "
        "x.addressable_data(0) for this process's shard")


def _is_torchax(value: Any) -> bool:
    torchax = sys.modules.get("torchax.tensor")
    return torchax is not None and isinstance(value, torchax.Tensor)


class Jax(Runtime):
    """N JAX processes of one ``jax.distributed`` job (:mod:`colab_xla.runtimes.jax`)."""

    name = "jax"
    described_as = "JAX processes (jax.distributed)"
    replicas_are = "JAX processes"
    started_code = BACKEND_STARTED
    starting_calls = STARTING_CALLS

    # -- the notebook's half ----------------------------------------------------------

    def check_installed(self) -> None:
        check_installed()

    def check_launch(self, launch) -> None:
        refuse_xmp_launch(launch, self.name, "JAX processes")

    def plan(self, requested: Optional[int], hardware: Hardware, *,
             simulate: Optional[str] = None, devices_per_process: Optional[int] = None,
             environ: Optional[Mapping[str, str]] = None) -> ReplicaPlan:
        return plan(requested, hardware, devices_per_process, environ or {})

    def own_processes(self, plan: ReplicaPlan) -> bool:
        return True  # JAX processes are never xmp.spawn's

    def problems(self) -> List[Problem]:
        return [p for p in (backend_problem(),) if p is not None]

    def run_environ(self, environ: Mapping[str, str], free_port: Callable[[], int],
                    unix_socket: Optional[Callable[[str], Optional[str]]] = None
                    ) -> Dict[str, str]:
        # Where jax.distributed's processes meet (process 0 serves): a cluster's host
        # brings host 0's.
        if COORDINATOR in environ:
            return {}
        return {COORDINATOR: coordinator_address(free_port, unix_socket)}

    def cluster_replicas(self, host: Mapping[str, Any]) -> Optional[int]:
        # One process drives every chip of a TPU host.
        return 1 if host["device"] == "TPU" else host["replicas"]

    def check_cluster(self, hosts, launch) -> None:
        if launch.devices_per_process is not None and any(d["device"] == "TPU" for d in hosts):
            raise OptionError(f"--devices-per-process {launch.devices_per_process}: on a TPU "
                              "host the JAX runtime runs one process driving every chip of "
                              "the host; leave it out (it is for CPU hosts).")

    def cluster_environ(self, hosts, coordinator: Callable[[], str]) -> Dict[str, str]:
        return {COORDINATOR: coordinator()}  # every host's processes are one job

    # -- the replica's half -----------------------------------------------------------

    def start_process(self, process, job) -> None:
        join()  # (jax.distributed starts before the first cell: before_cell)

    def device(self) -> Any:
        return first_device()

    def before_cell(self) -> None:
        initialize()

    def after_process(self) -> None:
        leave()  # it waits for the others to end

    def to_host(self, value: Any) -> Any:
        return to_host(value)


RUNTIME = Jax()
