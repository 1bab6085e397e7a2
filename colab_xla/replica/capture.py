"""A replica's standard streams: what it prints reaches the notebook, labelled by replica;
what it would read fails at once.

Python-level output goes as frames (:class:`ReplicaStream`, one line per frame, through
the process's output ring during a run), per thread, so replicas that are threads of one
process keep their own ``sys.stdout``; C-level output (XLA, absl, libtpu, printf) goes
through fd 1 and 2 to named pipes the notebook reads. ``display()`` in a replica sends
what it shows to the notebook, in order with its lines; ``input()`` raises
:class:`StdinUnavailable` instead of waiting forever.
"""

from __future__ import annotations

import codecs
import copyreg
import ctypes
import functools
import importlib
import io
import os
import sys
import threading
import types
from typing import Any, Optional, Protocol, Tuple

from ..runtimes.thread import replica
from ..wire import displays
from ..wire.frames import DISPLAY, MAX_PAYLOAD


class _Process(Protocol):
    """What a stream needs of its replica process (:class:`.process.ReplicaProcess`,
    which sets the streams up and so is not imported here)."""

    writer: Any  # its colab_xla.wire.frames.ChannelWriter

    def ordinal(self) -> int: ...


class ReplicaStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of a replica: each line is a frame to the notebook.

    Text is buffered per thread up to a newline (one ``print`` is one frame) and sent on
    ``flush()``, so ``\\r`` progress bars update live. The replica flushes when the cell
    ends, raises or exits, so nothing printed before is lost.
    """

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, process: _Process, kind: int, name: str):
        super().__init__()
        self._process, self._kind, self.name = process, kind, name
        self._pending = _Pending()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text.__class__ is not str and not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        local = self._pending
        pending = local.text + text if local.text else text
        if "\n" not in text and len(pending) <= MAX_PAYLOAD:  # (print's text before "\n")
            local.text = pending
            return len(text)
        cut = pending.rfind("\n") + 1
        if len(pending) > MAX_PAYLOAD:
            cut = len(pending)
        if cut:
            self._send(pending[:cut] if cut < len(pending) else pending)
        local.text = pending[cut:]
        return len(text)

    def flush(self) -> None:
        local = self._pending
        pending = local.text
        if pending:
            local.text = ""
            self._send(pending)

    def _send(self, text: str) -> None:
        self._process.writer.send(self._kind, self._process.ordinal(),
                                  text.encode("utf-8", "replace"))

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


class _Pending(threading.local):
    text = ""  # what a thread wrote since its last newline


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


class _Redirected(threading.local):
    stream = _UNSET  # (a class default: reading it where no thread assigned one is fast)


class _ThreadStream:
    """What ``sys.stdout`` (or ``sys.stderr``) holds in a replica process: it writes to
    the calling thread's own stream, the replica's unless that thread replaced it.

    Replicas on CPU (and TPU v2/v3) are threads of one process, so a plain
    ``sys.stdout = f`` or ``contextlib.redirect_stdout(f)`` in one replica would take
    every replica's output. Here each thread's assignment is its own (see
    :func:`streams_per_thread`); threads the cell starts write to the replica's stream.
    """

    def __init__(self, default):
        self.default = default
        self._local = _Redirected()

    def target(self):
        stream = self._local.stream
        return self.default if stream is _UNSET else stream

    def redirect(self, stream) -> None:
        if stream is self or stream is self.default:
            self._local.__dict__.pop("stream", None)
        else:
            self._local.stream = stream

    def write(self, text):  # (target(), inlined: every print of a replica comes here)
        stream = self._local.stream
        if stream is _UNSET:
            stream = self.default
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


def streams_per_thread(stdout, stderr) -> None:
    """Make ``stdout``/``stderr`` this process's streams, assignable per thread."""
    for name, stream in (("stdout", stdout), ("stderr", stderr)):
        vars(sys)[name] = _ThreadStream(stream)
    sys.__class__ = _ReplicaSys
    # Modules imported from now on are _ReplicaSys too (see above). Pickled, a module is
    # a reference to import (cloudpickle does so for modules, but by exact type: a class
    # of the cell that used a module first imported here failed to reach a spawned
    # DataLoader worker, "cannot pickle '_ReplicaSys' object").
    copyreg.pickle(_ReplicaSys, _module_by_name)


def _module_by_name(module):
    return importlib.import_module, (module.__name__,)


_MIME_NAMES = {"application/vnd.jupyter.widget-view+json": "a widget"}


def replica_display(stdout: ReplicaStream, stderr: ReplicaStream) -> None:
    """Send what ``display()`` (and ``plt.show()``, which displays the figure) shows in a
    replica to the notebook, in order with the replica's output.

    A forked replica inherits the notebook's IPython shell, whose display publisher sends
    on the kernel's sockets: from a replica that never reaches the browser. Here it is
    replaced: a bundle with something to draw (an image, HTML, Markdown: see
    :mod:`colab_xla.wire.displays`) goes to the notebook, which draws it in the replica's
    output; an object with a text form only becomes output lines; a widget, which a replica
    cannot draw, is named once per replica. Without a shell (spawn, forkserver), IPython's
    display() prints already.
    """
    shell = inherited_shell()
    if shell is None:
        return
    from IPython.core.displaypub import DisplayPublisher

    told = set()

    class ReplicaDisplayPublisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None,
                    update=False, **kwargs) -> None:
            bundle = displays.kept(data)
            process = stdout._process
            if any(m != "text/plain" for m in bundle) and process.run_dir:
                # What it printed before comes first: the streams' frames go ahead.
                stdout.flush()
                stderr.flush()
                name = displays.save(process.run_dir, bundle)
                process.writer.send(DISPLAY, process.ordinal(), name.encode())
                data = {m: v for m, v in data.items() if m not in bundle}
                if not data:
                    return
            text = data.get("text/plain")
            shown = not displays.says_nothing(text)
            if shown:
                stdout.write(text.rstrip("\n") + "\n")
            ordinal = replica()
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

    shell.display_pub = ReplicaDisplayPublisher(shell=shell)


def inherited_shell():
    """The notebook's IPython shell, as a forked replica inherited it; None in a process
    without one (spawn, forkserver, a cluster host's replicas). Imports nothing."""
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is None or not shell_module.InteractiveShell.initialized():
        return None
    return shell_module.InteractiveShell.instance()


def flush_all() -> None:
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


def capture_fds(paths: Tuple[str, str]) -> None:
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


def no_stdin() -> None:
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
