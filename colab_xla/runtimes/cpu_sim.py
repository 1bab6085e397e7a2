"""The CPU simulation of a TPU host, inside the replicas, in one of two models
(:data:`colab_xla.runtimes.simulation.SIMULATIONS`, which also plans their variables).

* ``processes`` (the default): one process per replica, each with one CPU device, as on
  every TPU since v4 (one process per chip). Each replica has its own interpreter state:
  random generators, torch.distributed's process group, module objects. XLA's CPU client
  cannot connect processes, so their collectives go through shared memory between the
  processes of one machine (:mod:`colab_xla.runtimes.shm_collectives`) and gloo between
  machines (:mod:`colab_xla.runtimes.gloo_collectives`, :func:`install_processes`).
  xmp.spawn runs a single process on CPU whatever the count, so colab_xla starts these
  processes itself (:func:`colab_xla.notebook.launch.start`).
* ``threads``: the replicas are N CPU devices of one process (``CPU_NUM_DEVICES=N``),
  threads, as torch_xla's CPU backend runs them and as TPU v2/v3 hosts did. Its
  collectives between those threads hang or abort as torch_xla ships them;
  :func:`install` makes them work by patching private functions of ``torch_xla._XLAC``
  and of ``xla_model``.

Every patch is checked first against the running torch_xla: a release that renamed
what one needs gets a clear note, and runs without it, instead of a crash deep in a
replica.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
from typing import Dict, List

from .thread import current

# What install() patches or calls in torch_xla._XLAC: private, so checked before use.
XLAC_FUNCTIONS = ("_xla_step_marker", "_xla_sync_multi", "_xla_get_default_device",
                  "_xla_wait_device_ops", "_xla_real_devices",
                  "_set_xla_handle_special_scalars", "_set_xla_enable_device_data_cache")
# The torch_xla releases the simulation was tested with (tests/test_collectives.py).
TESTED_RELEASES = ("2.8", "2.9")

_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


def missing(xlac, xm) -> List[str]:
    """What :func:`install` needs and this torch_xla lacks (a release that renamed it)."""
    lacking = [f"torch_xla._XLAC.{name}" for name in XLAC_FUNCTIONS if not hasattr(xlac, name)]
    lacking += [f"xla_model.{name}" for name in ("all_gather", "xla_rendezvous")
                if not hasattr(xm, name)]
    return lacking


def unsupported_note(lacking: List[str], version: str) -> str:
    return (f"colab_xla: torch_xla {version} lacks what the CPU simulation of collectives "
            f"patches ({', '.join(lacking)}; tested with torch_xla "
            f"{' and '.join(TESTED_RELEASES)}): replicas run without it, and a collective "
            "between CPU replicas may hang or see one replica. Use one of those releases "
            "for collectives on CPU, or run one replica (-n 1).")


def install_processes(rank: int, world: int, store, hostname: str = "127.0.0.1", *,
                      one_machine: bool = False) -> bool:
    """Make this process replica ``rank`` of ``world`` replica processes, collectives
    included (through gloo, met at ``store``, from ``hostname``; with ``one_machine``,
    through shared memory where the machine has it: :mod:`.shm_collectives`); False
    (with a note on stderr) if this torch_xla lacks what it needs."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from . import gloo_collectives

    lacking = gloo_collectives.missing(xr, xm, torch_xla._XLAC)
    if lacking:
        print(unsupported_note(lacking, getattr(torch_xla, "__version__", "?")),
              file=sys.stderr, flush=True)
        return False
    from . import shm_collectives

    if one_machine:
        share_cores(world)
    if one_machine and shm_collectives.available():
        group = shm_collectives.ShmGroup(store, rank, world)
    else:
        group = gloo_collectives.GlooGroup(store, rank, world, hostname=hostname)
    gloo_collectives.install(group)
    return True


def share_cores(processes: int) -> None:
    """Give this replica process its share of the machine's cores for torch's CPU work
    (``cores // processes``, at least 1), as torchrun does (OMP_NUM_THREADS=1 for more than
    one process), unless the user set OMP_NUM_THREADS. Otherwise each of N processes runs
    a pool of as many threads as cores, and the replicas' copies and reductions (a
    collective's, a DataLoader's) wait on each other's spinning threads. XLA's own CPU
    threads are not torch's and are left alone."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, processes)))


def install(xm) -> bool:
    """The ``threads`` model: make collectives work between CPU replicas that are threads
    of one process; False
    (with a note on stderr) if this torch_xla lacks what it patches.

    An XLA CPU collective meets its peers by an id taken from the compiled program, and
    every compilation gets a new one: replicas compiling the same step at the same time
    wait for each other at different ids until XLA aborts the process. So here every
    compilation happens under one lock; the first replica compiles the step and the
    others find it in the compilation cache, with the same id. Executions stay
    concurrent (they must: a collective needs every replica in it), and so does waiting
    for results. A collective is compiled right where it is called, as a program of its own
    (instead of inside the next implicit ``.cpu()``/``.item()``, which Python cannot
    intercept): two more graphs per collective, the price of a simulation that works
    every time.
    """
    import torch
    import torch_xla

    xlac = torch_xla._XLAC
    lacking = missing(xlac, xm)
    if lacking:
        print(unsupported_note(lacking, getattr(torch_xla, "__version__", "?")),
              file=sys.stderr, flush=True)
        return False
    compile_lock = threading.Lock()
    device_locks: Dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
    step_marker, sync_multi = xlac._xla_step_marker, xlac._xla_sync_multi

    @contextlib.contextmanager
    def compiling():
        # A new graph first waits for its device's work in flight (a collective waiting
        # for its peers, say). That wait must happen outside the compile lock the peers
        # need, and no other thread of the same device (an MpDeviceLoader's) may queue
        # work in between: one submitter per device, then the compile lock.
        device = xlac._xla_get_default_device()
        with device_locks[device]:
            xlac._xla_wait_device_ops(devices=xlac._xla_real_devices([device]))
            with compile_lock:
                yield

    def locked_step_marker(device, devices, wait=False, **kwargs):
        with compiling():
            step_marker(device, devices, wait=False, **kwargs)
        if wait:
            xlac._xla_wait_device_ops(devices=devices)

    def locked_sync_multi(tensors, devices, wait=True, **kwargs):
        with compiling():
            sync_multi(tensors, devices, wait=False, **kwargs)
        if wait:  # compiled already: this only waits for the results
            sync_multi(tensors, devices, wait=True, **kwargs)

    arrivals = _Arrivals(int(os.environ["CPU_NUM_DEVICES"]))

    def compiled_where_called(collective):
        @functools.wraps(collective)
        def call(*args, **kwargs):
            # The collective runs as a program of its own: its inputs are computed first,
            # apart. (A collective inside a whole training step hangs between CPU replica
            # threads at the second step; alone, it meets its peers every time.)
            locked_step_marker(xlac._xla_get_default_device(), [])
            # XLA's CPU collective gives up on its peers 10 s after the first arrives (it
            # aborts the process): the others may still be compiling, one at a time, under
            # load. So every replica is here before any runs it.
            arrivals.wait()
            result = collective(*args, **kwargs)
            locked_step_marker(xlac._xla_get_default_device(), [])
            return result
        # Under torch.compile, a graph break (Unsupported with fullgraph=True), as torch_xla
        # on a host of several devices per process: Dynamo cannot trace its world size there.
        return functools.wraps(collective)(torch._dynamo.disable(call))

    xlac._xla_step_marker, xlac._xla_sync_multi = locked_step_marker, locked_sync_multi
    xm.xla_rendezvous = _ThreadRendezvous(int(os.environ["CPU_NUM_DEVICES"])).exchange
    # all_gather's default (pin_layout=True) is an all_reduce of a tensor padded by the
    # replica's own ordinal: another program on every replica. The native all-gather is
    # the same program everywhere.
    # (A list keeps torch_xla's default: its pinned all-gather of a list is refused.)
    all_gather = xm.all_gather
    xm.all_gather = functools.wraps(all_gather)(
        lambda value, *args, pin_layout=None, **kwargs: all_gather(
            value, *args, pin_layout=(not isinstance(value, torch.Tensor) if pin_layout is None
                                      else pin_layout), **kwargs))
    # The same step must be the same program on every replica, whatever the values: by
    # default scalars 0 and 1 are folded in as constants, and equal scalars share one
    # cached buffer (one parameter fewer), so `x * index` compiles differently on some
    # replicas and their collective never meets the others'. Keep every scalar as its own
    # data. (Settings read when torch_xla is imported, before the fork: set here.)
    xlac._set_xla_handle_special_scalars(False)
    xlac._set_xla_enable_device_data_cache(False)
    for name in _COLLECTIVES:
        if hasattr(xm, name):
            setattr(xm, name, compiled_where_called(getattr(xm, name)))
    _first_item_alone(torch_xla)
    _refuse_dynamo()
    return True


# torch.compile's error in the threads model (see _refuse_dynamo).
THREADS_NO_DYNAMO = (
    "torch.compile(backend='openxla') cannot run with --simulate threads: torch_xla's "
    "Dynamo bridge does not support several XLA devices in one process (a TPU v2/v3 host's "
    "runtime; here the replicas' compiled graphs and collectives abort the process). Run "
    "the cell with --simulate processes (the default), or torch_xla.compile instead.")


def _refuse_dynamo() -> None:
    """``torch.compile(backend='openxla')`` (and ``openxla_eval``) raise
    :data:`THREADS_NO_DYNAMO` when they compile, instead of aborting every replica."""
    try:
        from torch._dynamo.backends import torchxla
    except ImportError:
        return
    if not hasattr(torchxla, "xla_backend_helper"):
        return

    @functools.wraps(torchxla.xla_backend_helper)
    def refused(*args, **kwargs):
        raise RuntimeError(THREADS_NO_DYNAMO)

    torchxla.xla_backend_helper = refused


def _first_item_alone(torch_xla) -> None:
    """Call ``.item()`` once here, before the other replica threads go on.

    torch_xla runs ``.item()`` (``aten::_local_scalar_dense``) through its CPU fallback,
    which counts each op in a process-wide hash map and inserts an op's first entry
    without a lock: replica threads whose first ``.item()`` came at the same moment
    crashed the process with SIGSEGV (about one run in 16 of a 4-replica cell ending in
    ``x.sum().item()``; a core dump showed the map's insert under ``xla_fallback``). Once
    the entry exists, they only read it. (Other ops that fall back to the CPU still race
    on their first use: that is torch_xla's to fix; one process per replica, the
    default, never shares the map.)
    """
    import torch

    torch.zeros((), device=torch_xla.device()).item()


class _Arrivals:
    """A barrier of the replica threads, round after round, that an Interrupt reaches (a
    replica thread gets it between two waits)."""

    def __init__(self, replicas: int):
        self._replicas, self._arrived, self._round = replicas, 0, 0
        self._cond = threading.Condition()

    def wait(self) -> None:
        with self._cond:
            round_ = self._round
            self._arrived += 1
            if self._arrived == self._replicas:
                self._arrived, self._round = 0, round_ + 1
                self._cond.notify_all()
            while self._round == round_:
                self._cond.wait(0.1)


class _ThreadRendezvous:
    """``xm.xla_rendezvous`` for CPU replicas that are threads of one process: payloads are
    exchanged in memory (``xm.rendezvous`` and ``xm.mesh_reduce`` use it). torch_xla's own
    runs several graphs and collectives per call, each a chance for the peers to diverge;
    threads can simply meet."""

    def __init__(self, replicas: int):
        self._replicas = replicas
        self._cond = threading.Condition()
        self._rounds: Dict[int, Dict[int, bytes]] = {}
        self._taken: Dict[int, int] = {}
        self._next_round: Dict[int, int] = {}

    def exchange(self, payload: bytes = b"", ordinals=None, tag=None):
        import torch_xla

        if not isinstance(payload, bytes):
            raise TypeError(f"`payload` must be bytes, not {type(payload)}")
        if ordinals and len(ordinals) != self._replicas:
            raise ValueError("Only global rendezvous is supported")
        torch_xla.sync()  # as torch_xla's: what the replica queued runs first
        ordinal = current.ordinal
        with self._cond:
            round_ = self._next_round.get(ordinal, 0)
            self._next_round[ordinal] = round_ + 1
            arrived = self._rounds.setdefault(round_, {})
            arrived[ordinal] = payload
            self._cond.notify_all()
            while len(arrived) < self._replicas:
                self._cond.wait()
            payloads = [arrived[o] for o in sorted(arrived)]
            self._taken[round_] = self._taken.get(round_, 0) + 1
            if self._taken[round_] == self._replicas:  # everyone has read: forget it
                del self._rounds[round_], self._taken[round_]
        return payloads
