"""What runs inside each replica: the cell's namespace, output capture, and the report.

:func:`main` is the function xmp.spawn calls as ``main(index, job)``; it is module-level
in an importable module, so it pickles. On CPU, and on TPU v2/v3, several replicas are
threads of one process, so output is routed by the replica of the calling thread, not by
process.

In each replica the cell sees the notebook's names (every one, inherited through fork; with
``spawn`` or a forkserver, those the cell mentions, sent with cloudpickle) and:

* ``index``: the replica's ordinal (what xmp.spawn passes to its function);
* ``device``: this replica's XLA device, created on first use (``torch_xla.device()``);
* ``lock``: a lock shared by all replicas, for ``with lock: print(...)``.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import contextvars
import ctypes
import functools
import importlib.util
import io
import json
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import cloudpickle

from .transport import names, shared_tensors
from .cell import CellModule
from .transport.frames import END, MAX_PAYLOAD, NOTE, START, STDERR, STDOUT, ChannelWriter
from .transport.names import REPLICA_NAMES  # noqa: F401 - they shadow notebook names
from .outcome import RETURN_PLAIN_DATA, ReplicaError, ReplicaReport

_VALUE_REPR_LIMIT = 500  # for the views; the value itself comes whole through -o

# Set in the notebook just before the fork, read by the replicas: run id -> state.
_FORKED: Dict[str, "ForkedState"] = {}


@dataclass(frozen=True)
class ForkedState:
    """What a forked replica inherits instead of receiving it pickled."""

    user_ns: Dict[str, Any]
    cell: CellModule


@dataclass(frozen=True)
class ReplicaJob:
    """What xmp.spawn passes (pickled) to every replica process."""

    run_id: str
    run_dir: str
    channel_path: str  # the named pipe of frames (see colab_xla.transport.frames)
    parent_pid: int  # the replica process's parent: the notebook, or the forkserver
    lock: Any = None  # a Manager lock proxy (pickles, works across processes), if used
    # Named pipes (stdout, stderr), one pair per replica process (by local rank): C-level
    # output (XLA, absl, libtpu logs, printf) goes there, read by the notebook.
    fd_paths: Tuple[Tuple[str, str], ...] = ()
    # A named pipe for fd 1 and 2 of every replica process from its first moment until its
    # rank is known (what torch_xla's runtime start-up prints, and its fatal errors).
    startup_path: Optional[str] = None
    # The replicas' whole environment: the notebook's, with the run's variables.
    environ: Optional[Dict[str, str]] = None
    # Without fork (spawn, forkserver): the cell and the notebook names it uses.
    cell: Optional[CellModule] = None
    names: Optional[bytes] = None
    cache_dir: Optional[str] = None  # --cache: torch_xla's persistent compilation cache
    pull: Tuple[str, ...] = ()  # --pull: names sent back after the cell
    pull_from: Optional[int] = None  # --pull-from: only this replica sends them
    shm_dir: Optional[str] = None  # where large CPU tensors go (colab_xla.transport.shared_tensors)

    def __reduce__(self):
        return _arrive, (dict(self.__dict__),)

    def apply_environ(self) -> None:
        """Make this process's environment the one the notebook chose for the replicas."""
        if self.environ is not None and dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)


def _arrive(fields: Dict[str, Any]) -> ReplicaJob:
    """Unpickle the job in a replica process, and set its environment there and then.

    Unpickling is the first code of colab_xla that runs in a replica process, before
    torch_xla starts the runtime (which reads PJRT_DEVICE, CPU_NUM_DEVICES, XLA_FLAGS...).
    A forkserver's children inherit the server's environment, not the notebook's, so
    waiting for ``main`` would be too late.
    """
    job = ReplicaJob(**fields)
    job.apply_environ()
    if job.startup_path:
        _capture_startup(job.startup_path)
    return job


def _capture_startup(path: str) -> None:
    """fd 1 and 2 of a replica process to the run's start-up pipe, before torch_xla starts
    its runtime there; and Python's fatal-error handler on, so a native crash (XLA's abort
    on a bad flag, a segfault) leaves the stack of every thread in the process output."""
    import faulthandler

    _libc().fflush(None)
    fd = os.open(path, os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(file=2, all_threads=True)


def report_path(run_dir: str, ordinal: int) -> str:
    return os.path.join(run_dir, f"report-{ordinal}.pkl")


def main(index: int, job: ReplicaJob) -> None:
    """Run the cell as replica ``index`` and send its report; never raises."""
    started = time.perf_counter()
    proc = _ProcessState.get(job)
    _local.ordinal = index
    proc.enter(index)
    try:
        proc.writer.send(START, index, json.dumps({"pid": os.getpid(), "rank": proc.rank}).encode())
        report = _run_cell(index, job, proc)
        report.elapsed = time.perf_counter() - started
        _write_report(job, report)
        if proc.leave(index):  # the process's last replica: what the cell started ends now
            end_descendants()
        proc.writer.send(END, index, b"")
    finally:
        proc.leave(index)
        _local.ordinal = None


# --- the cell -----------------------------------------------------------------------------


class ReplicaGlobals(dict):
    """The cell's globals: ``device`` is resolved on first use, in the replica's thread."""

    def __missing__(self, key):
        if key == "device":
            import torch_xla

            value = self["device"] = torch_xla.device()
            return value
        raise KeyError(key)


class _ReplicaModule(types.ModuleType):
    """The replica's ``sys.modules`` entry for the cell: attributes are its globals.

    Each replica has its own module name (``<cell>_r<ordinal>``), because replicas that
    are threads of one process share ``sys.modules``, and pickling by reference must
    find each replica's own definitions from any thread (a Pool's feeder thread, say).
    """

    def __init__(self, name: str, path: str, namespace: dict):
        super().__init__(name)
        self.__dict__.update(__file__=path, _replica_globals=namespace)

    def __getattr__(self, name):
        try:
            return self.__dict__["_replica_globals"][name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None


def module_name(cell: CellModule, ordinal: int) -> str:
    return f"{cell.name}_r{ordinal}"


def _replica_module(cell: CellModule, ordinal: int, run_dir: str, ns: dict) -> types.ModuleType:
    """Register the replica's module; its file (a link to the cell's) imports by name."""
    name = module_name(cell, ordinal)
    path = os.path.join(run_dir, name + ".py")
    if not os.path.exists(path):
        os.link(cell.path, path)
    module = sys.modules[name] = _ReplicaModule(name, path, ns)
    cloudpickle.register_pickle_by_value(module)  # the notebook gets the cell's classes
    return module


def _run_cell(index: int, job: ReplicaJob, proc: "_ProcessState") -> ReplicaReport:
    report = ReplicaReport(ordinal=index, pid=os.getpid(), elapsed=0.0)
    if proc.names_error is not None:
        report.error = proc.names_error
        return report
    cell = proc.cell
    ns = ReplicaGlobals({k: v for k, v in proc.user_ns.items() if k not in REPLICA_NAMES})
    name = module_name(cell, index)
    ns.update(__name__=name, __file__=cell.path, __builtins__=__builtins__,
              __doc__=None, __package__=None, __spec__=None, __loader__=None, index=index,
              get_ipython=replica_shell)
    if job.lock is not None:  # made only for cells that name it
        ns["lock"] = job.lock
    _replica_module(cell, index, job.run_dir, ns)
    value = None
    try:
        exec(cell.body, ns)
        value = eval(cell.last_expr, ns) if cell.last_expr is not None else None
    except SystemExit as exc:
        if exc.code not in (None, 0):
            report.error = ReplicaError("exit", "SystemExit", str(exc.code),
                                        f"the cell called sys.exit({exc.code!r})")
            return report
    except BaseException as exc:  # noqa: BLE001 - every failure becomes data
        # KeyboardInterrupt included: a replica runs in a thread the notebook's Interrupt
        # never reaches (the run kills it), so one here was raised by the cell's code.
        report.error = error_from_exception(exc, cell)
        return report
    finally:
        _flush_all()
    problems = []
    if value is not None:
        report.value_repr = _safe_repr(value)
        try:
            report.value = pack_value(value, job.shm_dir, proc.user_ns)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"the cell's value ({type(value).__name__}) could not be sent "
                            f"back to the notebook: {type(exc).__name__}: {exc}")
    if job.pull and job.pull_from in (None, index):
        report.pulled, failed = pull_names(ns, job.pull, job.shm_dir, proc.user_ns)
        problems.extend(failed)
    if problems:
        report.error = ReplicaError("result", "ResultError",
                                    "; ".join(problems) + ". " + RETURN_PLAIN_DATA)
    return report


_shell_lock = threading.RLock()


def replica_shell():
    """``get_ipython()`` in a replica, for the IPython magic lines of the cell (``%time``,
    ``%env``): the notebook's shell when the replica forked, else one made here, once per
    process. Either way its magic look-up is made safe for replica threads: IPython 8+
    loads some magics lazily on first use, and replicas racing there found none
    ("Magic `%time` is registered as lazy ... but loading it did not provide ...").
    """
    from IPython.core.interactiveshell import InteractiveShell

    with _shell_lock:
        if InteractiveShell.initialized():
            shell = InteractiveShell.instance()
        else:  # a fresh process: no history file shared by every replica process
            from traitlets.config import Config

            config = Config()
            config.HistoryManager.enabled = False
            shell = InteractiveShell.instance(config=config,
                                              user_module=sys.modules["__main__"])
        find = getattr(shell, "_find_with_lazy_load", None)  # IPython 8+
        if find is not None and not getattr(find, "_colab_xla_locked", False):
            def locked_find(*args, **kwargs):
                with _shell_lock:
                    return find(*args, **kwargs)

            locked_find._colab_xla_locked = True
            shell._find_with_lazy_load = locked_find
        return shell


def pull_names(ns: Mapping[str, Any], names, shm_dir: Optional[str] = None,
               notebook_ns: Mapping[str, Any] = types.MappingProxyType({})):
    """``--pull``: ``({name: pickled value}, [problem, ...])`` for the names of ``ns``; a
    name that is missing or cannot be pickled is a problem, the others are sent."""
    pulled, problems = {}, []
    for name in names:
        try:
            value = ns[name]
        except KeyError:
            problems.append(f"--pull {name}: no such name in the replica")
            continue
        try:
            pulled[name] = pack_value(value, shm_dir, notebook_ns)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"--pull {name} ({type(value).__name__}) could not be sent back "
                            f"to the notebook: {type(exc).__name__}: {exc}")
    return pulled, problems


def error_from_exception(exc: BaseException, cell: CellModule) -> ReplicaError:
    """The exception as data; the traceback starts at the cell and names its lines."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    first = next((i for i, f in enumerate(frames) if f.filename == cell.path), 0)
    te.stack = traceback.StackSummary.from_list(frames[first:])
    text = "".join(te.format())
    text = text.replace(f'File "{cell.path}", line ', f"{cell.label}, line ")
    # A class of the cell lives in each replica's own module (``<cell>_r3.B``): shown as the
    # cell wrote it (``B``), it reads right and the same error groups across replicas.
    text = re.sub(rf"\b{re.escape(cell.name)}_r\d+\.", "", text)
    return ReplicaError("exception", type(exc).__qualname__, _safe_str(exc), text)


def _safe_str(exc: BaseException) -> str:
    """``str(exc)``, which runs the exception's own code and may itself raise."""
    try:
        return str(exc)
    except Exception as failure:  # noqa: BLE001
        return f"<str() failed: {type(failure).__name__}: {_safe_str(failure)}>"


class _ResultPickler(cloudpickle.Pickler):
    """cloudpickle, with XLA tensors moved to CPU wherever they sit in the value (a model,
    a state dict, a list), and large CPU tensors sent through shared memory.

    An XLA tensor pickled as is would be rebuilt on an XLA device when the notebook loads
    it, initializing the runtime in the notebook's process.
    """

    def __init__(self, file, shm_dir: Optional[str], notebook_ns: Mapping[str, Any]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._shm_dir, self._notebook_ns = shm_dir, notebook_ns

    def reducer_override(self, obj):
        if _defined_in_notebook(obj, self._notebook_ns):
            # The notebook has this object (the replica got it through fork, or by value
            # under that name): send a reference, so results are instances of the
            # notebook's own classes.
            return _notebook_attribute, (obj.__qualname__,)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.device.type == "xla":
                if isinstance(obj, torch.nn.Parameter):  # .cpu() would drop the Parameter type
                    return torch.nn.Parameter, (obj.detach().cpu(), obj.requires_grad)
                obj = obj.cpu()
                return (shared_tensors.reduce_tensor(obj, self._shm_dir)
                        or obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL))
            shared = shared_tensors.reduce_tensor(obj, self._shm_dir)
            if shared is not None:
                return shared
        return super().reducer_override(obj)


def _defined_in_notebook(obj, notebook_ns: Mapping[str, Any]) -> bool:
    if not isinstance(obj, (type, types.FunctionType)) or obj.__module__ != "__main__":
        return False
    try:
        return _lookup(obj.__qualname__, notebook_ns) is obj
    except (AttributeError, KeyError):
        return False


def _lookup(qualname: str, ns: Mapping[str, Any]):
    head, *rest = qualname.split(".")
    return functools.reduce(getattr, rest, ns[head])


# The notebook's names while a value is loaded (see load_value).
_loading_ns = contextvars.ContextVar("colab_xla_loading_ns", default=None)


def _notebook_attribute(qualname: str):
    """The notebook's ``<qualname>`` (runs in the notebook when a result is loaded)."""
    ns = _loading_ns.get()
    if ns is None:
        ns = vars(sys.modules["__main__"])
    return _lookup(qualname, ns)


def pack_value(value: Any, shm_dir: Optional[str] = None,
               notebook_ns: Mapping[str, Any] = types.MappingProxyType({})) -> bytes:
    """Pickle a replica's value for the notebook (classes of the cell go by value; CPU
    tensors of 1 MiB or more through files in ``shm_dir``, when given; classes and
    functions of ``notebook_ns`` by name)."""
    buf = io.BytesIO()
    _ResultPickler(buf, shm_dir, notebook_ns).dump(value)
    return buf.getvalue()


def load_value(data: bytes, notebook_ns: Optional[Mapping[str, Any]] = None) -> Any:
    """In the notebook: a value packed by :func:`pack_value`, with references to the
    notebook's classes and functions resolved in ``notebook_ns``."""
    token = _loading_ns.set(notebook_ns)
    try:
        return pickle.loads(data)
    finally:
        _loading_ns.reset(token)


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001
        text = f"<{type(value).__name__}: repr failed: {exc}>"
    if len(text) > _VALUE_REPR_LIMIT:
        text = text[:_VALUE_REPR_LIMIT] + f"... [{len(text) - _VALUE_REPR_LIMIT} more characters]"
    return text


def _write_report(job: ReplicaJob, report: ReplicaReport) -> None:
    path = report_path(job.run_dir, report.ordinal)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(report, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(path + ".tmp", path)  # the notebook never reads half a report


# --- the replica's process ------------------------------------------------------------------

_local = threading.local()
_PR_SET_PDEATHSIG = 1


class _ProcessState:
    """Set up once per process and run: streams, parent-death signal, the cell module."""

    _lock = threading.Lock()
    _current: Optional["_ProcessState"] = None

    @classmethod
    def get(cls, job: ReplicaJob) -> "_ProcessState":
        with cls._lock:
            if cls._current is None or cls._current.run_id != job.run_id:
                cls._current = cls(job)
            return cls._current

    def __init__(self, job: ReplicaJob):
        self.run_id = job.run_id
        die_with_parent(job.parent_pid)
        adopt_orphans()
        # Named pipes, opened by path: a process started by spawn or a forkserver inherits
        # no descriptors from the notebook.
        self.writer = ChannelWriter(os.open(job.channel_path, os.O_WRONLY))
        self.active: set = set()
        self.rank = int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0"))
        if job.run_dir not in sys.path:
            sys.path.insert(0, job.run_dir)  # the cell's module imports by name
        self._capture_streams()
        if job.fd_paths:
            _capture_fds(job.fd_paths[self.rank % len(job.fd_paths)])
        _no_stdin()
        self.names_error: Optional[ReplicaError] = None
        if job.cell is None:  # forked: the notebook's names and cell are inherited
            forked = _FORKED[job.run_id]
            self.user_ns, self.cell = forked.user_ns, forked.cell
        else:
            self.user_ns, self.cell = self._load_names(job), job.cell
        _text_progress_bars()
        _send_cell_definitions_by_value()
        _serialize_forks()
        _report_exits(self.writer)
        if job.cache_dir:
            self._initialize_cache(job.cache_dir)
        self._instrument_torch_xla()

    def _load_names(self, job: ReplicaJob) -> Dict[str, Any]:
        try:
            return names.unpack(job.names) if job.names else {}
        except Exception as exc:  # noqa: BLE001 - every replica of the process says it
            message = (f"the notebook names the cell uses could not be loaded in the replica "
                       f"({type(exc).__name__}: {exc}). A module they need must be importable "
                       "by a fresh interpreter (installed, or on sys.path); or define them in "
                       "the cell, or use --start-method fork.")
            self.names_error = ReplicaError(
                "names", type(exc).__name__, message,
                "".join(traceback.format_exception(exc)) + message + "\n")
            return {}

    def _initialize_cache(self, cache_dir: str) -> None:
        """``--cache``: torch_xla's persistent compilation cache, one directory per replica
        process (its files are written without atomic renames), set before the process
        compiles anything, so a rerun loads the executables instead of compiling."""
        import torch_xla.runtime as xr

        path = os.path.join(cache_dir, f"process-{self.rank}")
        os.makedirs(path, exist_ok=True)
        xr.initialize_cache(path, readonly=False)

    def _instrument_torch_xla(self) -> None:
        """Record each replica's last ``xm.rendezvous`` tag (told when a run is cut), and
        refuse a nested ``xmp.spawn`` with the reason."""
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_multiprocessing as xmp

        rendezvous, writer = xm.rendezvous, self.writer

        def recorded_rendezvous(tag, *args, **kwargs):
            ordinal = getattr(_local, "ordinal", None)
            if ordinal is not None:
                writer.send(NOTE, ordinal, json.dumps({"rendezvous": str(tag)}).encode())
            return rendezvous(tag, *args, **kwargs)

        def nested_spawn(*args, **kwargs):
            raise RuntimeError("xmp.spawn was called inside a %%xla_spawn replica, which "
                               "would start replicas from every replica. Put the function's "
                               "body in the cell instead (`index` is the ordinal).")

        xm.rendezvous = functools.wraps(rendezvous)(recorded_rendezvous)
        xmp.spawn = functools.wraps(xmp.spawn)(nested_spawn)
        if os.environ.get("PJRT_DEVICE") == "CPU" and int(os.environ.get("CPU_NUM_DEVICES", "1")) > 1:
            _serialize_cpu_compiles(xm)

    def enter(self, ordinal: int) -> None:
        with self._lock:
            self.active.add(ordinal)

    def leave(self, ordinal: int) -> bool:
        """True for the call that took the process's last replica out."""
        with self._lock:
            was_in = ordinal in self.active
            self.active.discard(ordinal)
            return was_in and not self.active

    def default_ordinal(self) -> int:
        """Where output of a thread that is not a replica goes: its process's replica."""
        active = self.active
        return next(iter(active)) if len(active) == 1 else -1

    def _capture_streams(self) -> None:
        inherited = (sys.stdout, sys.stderr)
        streams = (ReplicaStream(self, STDOUT, "<replica stdout>"),
                   ReplicaStream(self, STDERR, "<replica stderr>"))
        _streams_per_thread(*streams)
        # The "original" streams are the replica's too: the notebook's would write to the
        # kernel's own stdout, or be lost in its buffer when the process ends.
        sys.__stdout__, sys.__stderr__ = streams
        # Objects made before the fork (logging handlers) still hold the notebook's
        # ipykernel streams; a forked child writing through them loses and mixes text.
        for old, new in zip(inherited, streams):
            if type(old).__module__.startswith("ipykernel"):
                old.write, old.flush = new.write, new.flush
        _replica_display(*streams)


_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


def _serialize_cpu_compiles(xm) -> None:
    """Make collectives work between CPU replicas that are threads of one process.

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
    import torch_xla

    xlac = torch_xla._XLAC
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

    def compiled_where_called(collective):
        @functools.wraps(collective)
        def call(*args, **kwargs):
            # The collective runs as a program of its own: its inputs are computed first,
            # apart. (A collective inside a whole training step hangs between CPU replica
            # threads at the second step; alone, it meets its peers every time.)
            locked_step_marker(xlac._xla_get_default_device(), [])
            result = collective(*args, **kwargs)
            locked_step_marker(xlac._xla_get_default_device(), [])
            return result
        return call

    xlac._xla_step_marker, xlac._xla_sync_multi = locked_step_marker, locked_sync_multi
    xm.xla_rendezvous = _ThreadRendezvous(int(os.environ["CPU_NUM_DEVICES"])).exchange
    # all_gather's default (pin_layout=True) is an all_reduce of a tensor padded by the
    # replica's own ordinal: another program on every replica. The native all-gather is
    # the same program everywhere.
    all_gather = xm.all_gather
    xm.all_gather = functools.wraps(all_gather)(
        lambda value, *args, pin_layout=False, **kwargs: all_gather(value, *args, pin_layout=pin_layout, **kwargs))
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
            raise TypeError(f"`payload` must be bytes, not {type(payload).__name__}")
        if ordinals and len(ordinals) != self._replicas:
            raise ValueError("Only global rendezvous is supported")
        torch_xla.sync()  # as torch_xla's: what the replica queued runs first
        ordinal = _local.ordinal
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


class ReplicaStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of a replica: each line is a frame to the notebook.

    Text is buffered per thread up to a newline (one ``print`` is one frame) and sent on
    ``flush()``, so ``\\r`` progress bars update live. The replica flushes when the cell
    ends, raises or exits, so nothing printed before is lost.
    """

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, proc: _ProcessState, kind: int, name: str):
        super().__init__()
        self._proc, self._kind, self.name = proc, kind, name
        self._pending = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        pending = getattr(self._pending, "text", "") + text
        cut = pending.rfind("\n") + 1
        if len(pending) > MAX_PAYLOAD:
            cut = len(pending)
        if cut:
            self._send(pending[:cut])
        self._pending.text = pending[cut:]
        return len(text)

    def flush(self) -> None:
        pending = getattr(self._pending, "text", "")
        if pending:
            self._pending.text = ""
            self._send(pending)

    def _send(self, text: str) -> None:
        ordinal = getattr(_local, "ordinal", None)
        if ordinal is None:
            ordinal = self._proc.default_ordinal()
        self._proc.writer.send(self._kind, ordinal, text.encode("utf-8", "replace"))

    def isatty(self) -> bool:
        return False

    @property
    def buffer(self) -> "_ReplicaBuffer":
        """``sys.stdout.buffer``: bytes, decoded as UTF-8 (per thread, so a character split
        between two writes arrives whole; what is not UTF-8 becomes U+FFFD)."""
        buffer = self.__dict__.get("_buffer")
        if buffer is None:
            buffer = self.__dict__["_buffer"] = _ReplicaBuffer(self)
        return buffer


class _ReplicaBuffer(io.BufferedIOBase):
    def __init__(self, stream: ReplicaStream):
        super().__init__()
        self._stream = stream
        self._local = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            decoder = self._local.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(data)
        if text:
            self._stream.write(text)
        return len(data)

    def flush(self) -> None:
        self._stream.flush()


_UNSET = object()


class _ThreadStream:
    """What ``sys.stdout`` (or ``sys.stderr``) holds in a replica process: it writes to
    the calling thread's own stream, the replica's unless that thread replaced it.

    Replicas on CPU (and TPU v2/v3) are threads of one process, so a plain
    ``sys.stdout = f`` or ``contextlib.redirect_stdout(f)`` in one replica would take
    every replica's output. Here each thread's assignment is its own (see
    :func:`_streams_per_thread`); threads the cell starts write to the replica's stream.
    """

    def __init__(self, default):
        self.default = default
        self._local = threading.local()

    def target(self):
        stream = getattr(self._local, "stream", _UNSET)
        return self.default if stream is _UNSET else stream

    def redirect(self, stream) -> None:
        if stream is self or stream is self.default:
            self._local.__dict__.pop("stream", None)
        else:
            self._local.stream = stream

    def write(self, text):
        stream = self.target()
        return len(text) if stream is None else stream.write(text)

    def flush(self) -> None:
        stream = self.target()
        if stream is not None:
            stream.flush()

    def __getattr__(self, name):
        return getattr(self.target(), name)


def _thread_stream_property(name: str) -> property:
    # importlib makes every new module as ``type(sys)(name)``: once ``sys`` is a
    # _ReplicaSys, so are modules imported later, and on them these are plain attributes
    # (IPython 7's IPython.utils.io assigns its own ``stdout``).
    def get(module):
        try:
            value = module.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}") from None
        return value.target() if isinstance(value, _ThreadStream) else value

    def set_(module, stream):
        value = module.__dict__.get(name)
        if isinstance(value, _ThreadStream):  # sys (a new module never holds one)
            value.redirect(stream)
        else:
            module.__dict__[name] = stream

    def delete(module):
        try:
            del module.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None

    return property(get, set_, delete, doc=f"``sys.{name}`` of the calling thread")


class _ReplicaSys(types.ModuleType):
    """The class of ``sys`` in a replica process: ``sys.stdout`` and ``sys.stderr`` are
    per thread. Python code reads and assigns them through these properties; print() and
    the interpreter read the module's dictionary, which holds a :class:`_ThreadStream`."""

    stdout = _thread_stream_property("stdout")
    stderr = _thread_stream_property("stderr")


def _streams_per_thread(stdout, stderr) -> None:
    """Make ``stdout``/``stderr`` this process's streams, assignable per thread."""
    for name, stream in (("stdout", stdout), ("stderr", stderr)):
        vars(sys)[name] = _ThreadStream(stream)
    sys.__class__ = _ReplicaSys


_DEFAULT_REPR = re.compile(r"<.* object(?: at 0x[0-9a-f]+)?>|<Figure size .*>", re.DOTALL)
_MIME_NAMES = {"application/vnd.jupyter.widget-view+json": "a widget"}


def _replica_display(stdout: ReplicaStream, stderr: ReplicaStream) -> None:
    """Make ``display()`` (and ``plt.show()``, which displays the figure) in a replica say
    what it shows instead of vanishing.

    A forked replica inherits the notebook's IPython shell, whose display publisher sends
    on the kernel's sockets: from a replica that never reaches the browser. Here it is
    replaced: an object's text form (``text/plain``) becomes output lines of the replica;
    what only a notebook can draw (images, HTML, widgets) is named once per replica and
    kind. Without a shell (spawn, forkserver), IPython's display() prints already.
    """
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is None or not shell_module.InteractiveShell.initialized():
        return
    from IPython.core.displaypub import DisplayPublisher

    told = set()

    class ReplicaDisplayPublisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None,
                    update=False, **kwargs) -> None:
            text = data.get("text/plain")
            shown = isinstance(text, str) and not _DEFAULT_REPR.fullmatch(text.strip())
            if shown:
                stdout.write(text.rstrip("\n") + "\n")
            ordinal = getattr(_local, "ordinal", None)
            who = f"replica {ordinal}" if ordinal is not None else "a thread of a replica"
            for mime in data:
                drawn_only = mime.startswith(("image/", "application/vnd.jupyter"))
                if mime == "text/plain" or (shown and not drawn_only):
                    continue  # the text said it (a table's HTML, say)
                if (ordinal, mime) in told:
                    continue
                told.add((ordinal, mime))
                what = _MIME_NAMES.get(mime, mime)
                stderr.write(f"{who} displayed {what} (not shown: replicas cannot draw in "
                             f"the notebook); save it to a file, or return it as the cell's "
                             f"value (-o)\n")
            stdout.flush()
            stderr.flush()

        def clear_output(self, wait=False) -> None:
            pass

    shell = shell_module.InteractiveShell.instance()
    shell.display_pub = ReplicaDisplayPublisher(shell=shell)


def _flush_all() -> None:
    """At the end of a replica's cell: flush what it wrote, and give its thread the
    replica streams back (the pool may run another replica on the same thread)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream the cell replaced may be closed
            pass
    _restore_thread_streams()
    _libc().fflush(None)


def _restore_thread_streams(module=sys) -> None:
    """Undo what the calling thread assigned to ``sys.stdout``/``sys.stderr``."""
    for name in ("stdout", "stderr"):
        stream = vars(module).get(name)
        if isinstance(stream, _ThreadStream):
            stream.redirect(stream.default)


@functools.lru_cache(maxsize=None)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _capture_fds(paths: Tuple[str, str]) -> None:
    """Point fd 1 and 2 of this process at the notebook's pipes for it (C-level output)."""
    _libc().fflush(None)  # what C printed before belongs to the old destination
    for target, path in zip((1, 2), paths):
        fd = os.open(path, os.O_WRONLY)
        os.dup2(fd, target)
        os.close(fd)
    try:  # a pipe makes C stdout fully buffered: make it line-buffered, as on a terminal
        libc = _libc()
        libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, 1, 0)  # _IOLBF
    except (ValueError, AttributeError):  # no such symbol on this libc: flushed at exit
        pass


NO_STDIN = ("a replica cannot read the notebook's input: no prompt reaches it (the "
            "replicas run in other processes while the notebook waits). Ask in a notebook cell "
            "before %%xla_spawn and use the variable in the cell (for a password: "
            "getpass.getpass() in the notebook).")


class StdinUnavailable(EOFError):
    """``input()``, ``getpass``, ``sys.stdin`` or a debugger's prompt in a replica.

    An EOFError, as ``input()`` raises at the end of its input, so code written for an
    empty input still works; the message says what to do instead.
    """


class _NoStdin(io.TextIOBase):
    """A replica's ``sys.stdin``: every read fails at once, instead of waiting forever."""

    name = "<replica stdin>"

    def readable(self) -> bool:
        return True

    def read(self, size: Optional[int] = -1) -> str:
        raise StdinUnavailable(NO_STDIN)

    def readline(self, size: Optional[int] = -1) -> str:
        raise StdinUnavailable(NO_STDIN)

    def isatty(self) -> bool:
        return False


def _no_input(*args, **kwargs):
    raise StdinUnavailable(NO_STDIN)


def _no_stdin() -> None:
    """Nothing in a replica waits on the notebook's input. A forked replica inherited
    ipykernel's ``input``/``getpass``, which ask the browser over the kernel's sockets and
    would wait forever for an answer that goes to the notebook, not the replica."""
    import builtins
    import getpass

    builtins.input = _no_input
    getpass.getpass = _no_input
    sys.breakpointhook = _no_input  # a debugger would read EOF and go on without a word
    sys.stdin = sys.__stdin__ = _NoStdin()
    devnull = os.open(os.devnull, os.O_RDONLY)  # C-level reads: an empty input
    os.dup2(devnull, 0)
    os.close(devnull)


def _text_progress_bars() -> None:
    """Make ``tqdm.auto`` and ``tqdm.notebook`` the text bar in replicas: the notebook bar
    is a widget, and a forked replica cannot draw widgets (it has no connection to the
    browser)."""
    if importlib.util.find_spec("tqdm") is None:
        return
    import tqdm.std

    for name in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook"):
        module = types.ModuleType(name)
        module.tqdm, module.trange = tqdm.std.tqdm, tqdm.std.trange
        module.tqdm_notebook, module.tnrange = tqdm.std.tqdm, tqdm.std.trange
        sys.modules[name] = module
    tqdm_pkg = sys.modules.get("tqdm")
    for attr in ("auto", "autonotebook", "notebook"):
        if tqdm_pkg is not None:
            setattr(tqdm_pkg, attr, sys.modules[f"tqdm.{attr}"])


def _report_exits(writer: ChannelWriter) -> None:
    """``os._exit`` from a replica's thread says who called it before the process ends.

    It ends the whole process at once, and with it every replica that is a thread of it:
    without this note the notebook could only say that the process ended "without an
    exit code". (The pid tells a replica from a process it forked, which shares its
    thread's state and calls ``os._exit`` too when it ends.)
    """
    real_exit = os._exit

    def reported_exit(code):
        ordinal = getattr(_local, "ordinal", None)
        if ordinal is not None:
            with contextlib.suppress(Exception):
                _flush_all()
                writer.send(NOTE, ordinal, json.dumps({"exit": code, "pid": os.getpid()}).encode())
        real_exit(code)

    os._exit = functools.wraps(real_exit)(reported_exit)


def _send_cell_definitions_by_value() -> None:
    """Let processes the cell starts (a DataLoader's workers) receive its classes and
    functions, under every start method.

    A spawned or forkserver worker unpickles a ``Dataset`` by importing its class's
    module: for a class of the cell that would run the whole cell again, and a class of
    the notebook (``__main__`` there) cannot be imported at all. multiprocessing pickles
    with ``ForkingPickler``; here it sends such classes and functions by value, with
    cloudpickle, as the notebook's names reach a replica that does not fork. Everything
    else (tensors, plain data) pickles as before.
    """
    from multiprocessing.reduction import ForkingPickler

    def reducer_override(pickler, obj):
        if isinstance(obj, (type, types.FunctionType)) and not _importable(obj):
            return cloudpickle.loads, (cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),)
        return NotImplemented

    ForkingPickler.reducer_override = reducer_override


def _serialize_forks() -> None:
    """Replicas that are threads of one process fork one at a time (DataLoader workers, a
    Pool). On Python 3.12+, filelock 4.2 (torch imports it) audits os.fork and makes it raise
    RuntimeError("os.fork is unsafe while filelock is changing descriptor ownership") while
    another thread of the process is inside os.fork, which concurrent replicas often are."""
    if getattr(os.fork, "_colab_xla_serialized", False):
        return
    real_fork, lock = os.fork, threading.Lock()

    @functools.wraps(real_fork)
    def fork():
        with lock:  # in the child too: the forking thread is the one that goes on there
            return real_fork()

    fork._colab_xla_serialized = True
    os.fork = fork


def _importable(obj) -> bool:
    """Whether a fresh process importing ``obj.__module__`` gets ``obj`` without running
    a cell: not for the cell's own module, nor for what lives in a ``__main__``."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or isinstance(module, _ReplicaModule) or module.__name__ == "__main__":
        return False
    try:
        return _lookup(obj.__qualname__, vars(module)) is obj
    except (AttributeError, KeyError):
        return False


_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Make this replica process the parent of every orphan among its descendants (Linux).

    ``os.system('server &')`` or a double fork leaves a process whose parent has exited:
    it would go to init and out of reach. Adopted, it stays a descendant of the replica,
    which the run ends with everything else it started.
    """
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end_descendants() -> None:
    """SIGKILL every process this one started, and their own (by pid, never by name).

    Called when the last replica of the process has finished its cell: a subprocess, a
    forked child or a DataLoader worker the cell left running must not outlive the run,
    however short it was (the notebook's own clean-up comes after this process has gone,
    when its orphans would no longer be found).
    """
    import psutil

    victims = psutil.Process().children(recursive=True)
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    psutil.wait_procs(victims, timeout=3)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the notebook's process dies (Linux), so no replica
    outlives a kernel restart holding a TPU."""
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
