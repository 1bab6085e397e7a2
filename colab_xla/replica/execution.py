"""The cell run as a replica: the function xmp.spawn calls, and the cell it runs.

:func:`main` is called as ``main(index, job)`` in every replica; it is module-level in an
importable module, so it pickles. It runs the cell in the replica's own globals (the
notebook's names, ``index``, ``device``, ``lock``, ``get_ipython``), as a module of its own,
and leaves the report for the notebook; it never raises: every failure is data.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
import traceback
import types

import cloudpickle

from .. import runtimes
from ..runtimes import runtime_clients
from ..runtimes.thread import current
from ..wire import frames, stacks
from ..wire.cell import CellModule
from ..wire.reports import RETURN_PLAIN_DATA, ReplicaError, ReplicaReport
from ..wire.lifetime import end_descendants
from ..wire.frames import END, START
from ..wire.names import REPLICA_NAMES
from ..wire.values import end_payload, pack_value, pull_names, report_to_send, safe_repr
from ..wire.job import ReplicaJob
from .capture import flush_all, inherited_shell
from .process import ReplicaProcess


def main(index: int, job: ReplicaJob) -> None:
    """Run the cell as replica ``index`` and send its report; never raises."""
    serve_run(index, job, fresh_globals)


def serve_run(index: int, job: ReplicaJob, make_globals, end_started: bool = True) -> None:
    """Run ``job``'s cell as replica ``index`` in the globals ``make_globals(index, job,
    process)`` gives, and send its report. With ``end_started``, the process's last
    replica of the run ends what the cell started."""
    started = time.perf_counter()
    process = ReplicaProcess.get(job)
    current.ordinal = index
    process.enter(index)
    try:
        process.writer.send(START, index, json.dumps({
            "pid": frames.own_pid(), "rank": process.rank, "thread": threading.get_ident(),
            "stacks": stacks.registered()}).encode())
        report = _run_cell(index, job, process, make_globals)
        report.elapsed = time.perf_counter() - started
        sent = report_to_send(job.run_dir, report)
        if process.leave(index) and end_started:  # the last replica: what the cell started ends
            end_descendants()
        process.writer.send(END, index, end_payload(time.monotonic(), sent))
    finally:
        process.leave(index)
        current.ordinal = None

# --- the cell -----------------------------------------------------------------------------


class ReplicaGlobals(dict):
    """The cell's globals: ``device`` is resolved on first use, in the replica's thread."""

    def __missing__(self, key):
        if key == "device":
            value = self["device"] = runtimes.current().device()
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


def _replica_module(cell: CellModule, ordinal: int, ns: dict) -> types.ModuleType:
    """Register the replica's module; its file (a link to the cell's) imports by name, in
    this process and those it starts (a session's cells' files are not in their run's
    directory)."""
    name = module_name(cell, ordinal)
    directory = os.path.dirname(cell.path)
    path = os.path.join(directory, name + ".py")
    with contextlib.suppress(FileExistsError):  # (a cell this replica ran before)
        os.link(cell.path, path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    module = sys.modules[name] = _ReplicaModule(name, path, ns)
    cloudpickle.register_pickle_by_value(module)  # the notebook gets the cell's classes
    return module


def fresh_globals(index: int, job: ReplicaJob, process: "ReplicaProcess") -> ReplicaGlobals:
    """A one-off run's globals: the notebook's names, and the replica's own."""
    ns = ReplicaGlobals({k: v for k, v in process.user_ns.items() if k not in REPLICA_NAMES})
    return cell_globals(ns, index, job, process)


def cell_globals(ns: ReplicaGlobals, index: int, job: ReplicaJob,
                 process: "ReplicaProcess") -> ReplicaGlobals:
    """``ns`` made the globals of ``job``'s cell in replica ``index``, registered as the
    replica's module of the cell."""
    cell = process.cell
    ns.update(__name__=module_name(cell, index), __file__=cell.path,
              __builtins__=__builtins__, __doc__=None, __package__=None, __spec__=None,
              __loader__=None, index=index,
              get_ipython=lambda: _ReplicaIPython(replica_shell(), ns))
    if process.host_rank is not None:  # on a cluster: index counts the replicas of every host
        ns.update(index=process.host_rank.index(index), host=process.host_rank.host,
                  local_index=index)
    ns.pop("lock", None)
    if job.lock is not None:  # made only for cells that name it
        ns["lock"] = job.lock
    _replica_module(cell, index, ns)
    return ns


def _run_cell(index: int, job: ReplicaJob, process: "ReplicaProcess",
              make_globals) -> ReplicaReport:
    report = ReplicaReport(ordinal=index, pid=frames.own_pid(), elapsed=0.0)
    if process.names_error is not None:
        report.error = process.names_error
        return report
    cell = process.cell
    runtime = runtimes.current()
    ns = make_globals(index, job, process)
    value = None
    # In a session, the notebook's Interrupt reaches the cell (colab_xla.replica.serve).
    interruptible = getattr(current, "interruptible", None)
    current.failure = None  # (a session's %xla_debug debugs the last cell's exception)
    try:
        with (interruptible.running(job.run_id) if interruptible is not None
              else contextlib.nullcontext()):
            runtime.before_cell()  # (JAX: jax.distributed, once per process)
            exec(cell.body, ns)
            value = eval(cell.last_expr, ns) if cell.last_expr is not None else None
            try:
                show_pictures(value)
            except Exception:  # noqa: BLE001 - as a notebook's hook error: said, the cell done
                traceback.print_exc()
    except SystemExit as exc:
        if exc.code not in (None, 0):
            report.error = ReplicaError("exit", "SystemExit", str(exc.code),
                                        f"the cell called sys.exit({exc.code!r})")
            return report
    except BaseException as exc:  # noqa: BLE001 - every failure becomes data
        # KeyboardInterrupt included: raised by the cell's code, or in a session by the
        # notebook's Interrupt (the notebook knows which: it stopped the run).
        report.error = error_from_exception(exc, cell)
        if interruptible is not None:  # a session's replica: kept for %xla_debug
            current.failure = (exc, cell.path)
        return report
    finally:
        flush_all()
        runtime_clients.notice_torch_xla(f"a call in {cell.label}")  # (not by `device`)
    unsendable, missing = [], []
    # What the notebook can load (the JAX runtime's arrays as NumPy arrays).
    to_host = runtime.to_host
    if value is not None:
        report.value_repr = safe_repr(value)
        try:
            report.value = pack_value(to_host(value), job.shm_dir, process.user_ns)
        except Exception as exc:  # noqa: BLE001
            unsendable.append(f"the cell's value ({type(value).__name__}) could not be sent "
                              f"back to the notebook: {type(exc).__name__}: {exc}")
    if job.pull and job.pull_from in (None, index):
        report.pulled, missing, failed = pull_names(ns, job.pull, job.shm_dir,
                                                    process.user_ns, convert=to_host)
        unsendable.extend(failed)
    if unsendable or missing:
        hint = f" {RETURN_PLAIN_DATA}" if unsendable else ""  # (what to send instead)
        report.error = ReplicaError("result", "ResultError",
                                    "; ".join(unsendable + missing) + "." + hint)
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


def show_pictures(value) -> None:
    """What a notebook draws when a cell ends, drawn by the replica (its display goes to
    the notebook: :func:`colab_xla.replica.capture.replica_display`): the pyplot figures
    the cell changed, under the inline backend (as Jupyter, Colab and Kaggle set it: a
    figure shows without ``plt.show()``), and the cell's value if it has a picture (an
    image's ``_repr_png_``, a figure the first step did not just show)."""
    shell = inherited_shell()
    if shell is None:
        return
    pyplot = sys.modules.get("matplotlib.pyplot")
    inline = sys.modules.get("matplotlib_inline.backend_inline")
    shown = set()
    if pyplot is not None and inline is not None and "inline" in pyplot.get_backend():
        before = set(pyplot.get_fignums())
        inline.flush_figures()  # (shows and closes each figure the cell drew on)
        shown = before - set(pyplot.get_fignums())
    figures = sys.modules.get("matplotlib.figure")
    if value is None or (figures is not None and isinstance(value, figures.Figure)
                         and getattr(value, "number", None) in shown):
        return
    data, metadata = shell.display_formatter.format(value)
    if any(m.startswith("image/") for m in data):
        shell.display_pub.publish(data, metadata)


class _ReplicaIPython:
    """``get_ipython()`` in a replica's cell: the process's shell (:func:`replica_shell`),
    but ``name?`` (``%pinfo``, ``%pinfo2``) looks ``name`` up in the replica's globals, not
    in the shell's namespace (the notebook's, as it forked), and prints what it finds (a
    kernel's pager would send it where no browser reads)."""

    def __init__(self, shell, ns):
        self._shell, self._ns = shell, ns

    def __getattr__(self, name):
        return getattr(self._shell, name)

    def run_line_magic(self, magic_name, line, _stack_depth=1):
        if magic_name not in ("pinfo", "pinfo2"):
            return self._shell.run_line_magic(magic_name, line, _stack_depth + 1)
        shown = []

        def keep(data, start=0, screen_lines=0):
            shown.append(data.get("text/plain", "") if isinstance(data, dict) else str(data))

        hooks = self._shell.hooks.show_in_pager
        hooks.add(keep, -1)  # (before the kernel's: the chain runs by priority)
        try:
            self._shell._inspect("pinfo", line.strip(), namespaces=[("Replica", self._ns)],
                                 detail_level=1 if magic_name == "pinfo2" else 0)
        finally:
            hooks.chain = [(p, f) for p, f in hooks.chain if f is not keep]
        for text in shown:
            print(text)
        return None


# colab_xla's own source files (a frame of them is plumbing in a cell's traceback).
_OWN_FILES = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def error_from_exception(exc: BaseException, cell: CellModule) -> ReplicaError:
    """The exception as data; the traceback starts at the cell and names its lines, and
    leaves colab_xla's own frames out (``input()`` in a replica raises from colab_xla's
    stand-in: the cell's line is what matters)."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    first = next((i for i, f in enumerate(frames) if f.filename == cell.path), 0)
    te.stack = traceback.StackSummary.from_list(
        [f for f in frames[first:] if not f.filename.startswith(_OWN_FILES)] or frames[first:])
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
