"""A replica's report and the values in it, packed in the replica and loaded in the notebook.

The report (:class:`colab_xla.wire.reports.ReplicaReport`: the cell's value, ``--pull`` names,
its error, its time) is pickled into the replica's end frame, or, too large for a frame,
to a file of the run's private directory, renamed into place whole, that the end frame
announces. Values are pickled by
:func:`pack_value`: classes and functions of the cell go by value (cloudpickle), those of
the notebook by reference (results are instances of the notebook's own classes), XLA
tensors as CPU tensors (loading one must not start XLA in the notebook), and CPU tensors
of 1 MiB or more through shared memory (:mod:`.shared_tensors`).
"""

from __future__ import annotations

import contextvars
import functools
import io
import os
import pickle
import sys
import types
from typing import Any, Callable, Mapping, Optional

import cloudpickle

from .frames import ENDED_AT, MAX_PAYLOAD
from .reports import ReplicaReport
from . import shared_tensors

VALUE_REPR_LIMIT = 500  # for the views; the value itself comes whole through -o


class _ResultPickler(cloudpickle.Pickler):
    """cloudpickle, with XLA tensors moved to CPU wherever they sit in the value (a model,
    a state dict, a list), and large CPU tensors sent through shared memory.

    An XLA tensor pickled as is would be rebuilt on an XLA device when the notebook loads
    it, initializing the notebook process's XLA runtime.
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
        return lookup(obj.__qualname__, notebook_ns) is obj
    except (AttributeError, KeyError):
        return False


def lookup(qualname: str, ns: Mapping[str, Any]):
    head, *rest = qualname.split(".")
    return functools.reduce(getattr, rest, ns[head])


# The notebook's names while a value is loaded (see load_value).
_loading_ns = contextvars.ContextVar("colab_xla_loading_ns", default=None)


def _notebook_attribute(qualname: str):
    """The notebook's ``<qualname>`` (runs in the notebook when a result is loaded)."""
    ns = _loading_ns.get()
    if ns is None:
        ns = vars(sys.modules["__main__"])
    return lookup(qualname, ns)


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


def safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001
        text = f"<{type(value).__name__}: repr failed: {exc}>"
    if len(text) > VALUE_REPR_LIMIT:
        text = text[:VALUE_REPR_LIMIT] + f"... [{len(text) - VALUE_REPR_LIMIT} more characters]"
    return text


def pull_names(ns: Mapping[str, Any], names, shm_dir: Optional[str] = None,
               notebook_ns: Mapping[str, Any] = types.MappingProxyType({}),
               convert: Callable[[Any], Any] = lambda value: value):
    """``--pull``: ``({name: pickled value}, [missing], [unsendable])`` for the names of
    ``ns`` (each ``convert``-ed first): a problem for each name that is missing, and for
    each that cannot be sent; the others are sent."""
    pulled, missing, unsendable = {}, [], []
    for name in names:
        try:
            value = ns[name]
        except KeyError:
            missing.append(f"--pull {name}: no such name in the replica")
            continue
        try:
            pulled[name] = pack_value(convert(value), shm_dir, notebook_ns)
        except Exception as exc:  # noqa: BLE001
            unsendable.append(f"--pull {name} ({type(value).__name__}) could not be sent back "
                              f"to the notebook: {type(exc).__name__}: {exc}")
    return pulled, missing, unsendable


def report_path(run_dir: str, ordinal: int) -> str:
    """Where replica ``ordinal`` of the run in ``run_dir`` leaves its report."""
    return os.path.join(run_dir, f"report-{ordinal}.pkl")


# A report up to this size goes in the replica's end frame (one frame, written whole): a
# file for it costs every replica an open, a pickle.dump and a rename per cell, and the
# notebook an open and a load per replica.
FRAME_REPORT_BYTES = MAX_PAYLOAD - ENDED_AT.size


def report_to_send(run_dir: str, report: ReplicaReport) -> bytes:
    """In the replica: its report, pickled, for its end frame; or, larger than
    :data:`FRAME_REPORT_BYTES`, left in its file (whole or not at all) and ``b""``. A
    report whose packed values alone are too large goes to the file at once, pickled as
    it is written (not held whole in memory a second time)."""
    packed = len(report.value or b"") + sum(map(len, report.pulled.values()))
    data = (pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
            if packed <= FRAME_REPORT_BYTES else None)
    if data is not None and len(data) <= FRAME_REPORT_BYTES:
        return data
    path = report_path(run_dir, report.ordinal)
    with open(path + ".tmp", "wb") as f:
        if data is None:
            pickle.dump(report, f, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            f.write(data)
    os.replace(path + ".tmp", path)  # the notebook never reads half a report
    return b""


def read_report(run_dir: str, ordinal: int, sent: bytes = b"") -> ReplicaReport:
    """In the notebook: the report replica ``ordinal`` sent in its end frame (``sent``),
    else left in its file (its values still packed)."""
    if sent:
        return pickle.loads(sent)
    with open(report_path(run_dir, ordinal), "rb") as f:
        return pickle.load(f)


def end_payload(ended_at: float, report: bytes) -> bytes:
    """An end frame's payload: when the replica ended (see :data:`ENDED_AT`), then its
    report if it travels in the frame (:func:`report_to_send`)."""
    return ENDED_AT.pack(ended_at) + report


def ended_at(payload: bytes) -> Optional[float]:
    """When the replica of an end frame's ``payload`` ended (None: not said)."""
    return ENDED_AT.unpack_from(payload)[0] if len(payload) >= ENDED_AT.size else None


def sent_report(payload: bytes) -> bytes:
    """The report an end frame's ``payload`` carries (``b""``: it is in its file)."""
    return payload[ENDED_AT.size:]
