"""The notebook's Interrupt (SIGINT) as a flag that colab_xla checks, never an exception
raised wherever the kernel's main thread happens to be.

While a run goes on, the main thread also draws the live view, sending widget messages
through ipykernel and pyzmq. Raised as a KeyboardInterrupt wherever the main thread was, the
Interrupt of a widget run could be lost (the cell ran on, the main thread back in its
select) somewhere that was never found; a flag cannot be swallowed. And an import of torch
or torch_xla cut half-way leaves half-initialized modules in ``sys.modules`` for the
kernel's life. So within :func:`held`, SIGINT only sets :attr:`Interrupts.requested` (and
wakes a ``select`` on :attr:`Interrupts.wake_fd`); the code that holds it decides where to
stop.

Example::

    >>> import os, signal
    >>> with held() as interrupts:
    ...     os.kill(os.getpid(), signal.SIGINT)  # the user presses Interrupt
    ...     interrupts.requested
    True
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator, Optional


class Interrupts:
    """Whether SIGINT came while held (or another thread asked, :meth:`request`);
    ``wake_fd`` becomes readable when it does."""

    def __init__(self, wake_fd: Optional[int], wake_w: Optional[int] = None):
        self.requested = False
        self.wake_fd, self._wake_w = wake_fd, wake_w

    def raise_if_requested(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def request(self) -> None:
        """Interrupt, as SIGINT would (any thread may call it; a cluster's host agent
        does, told by the notebook)."""
        self.requested = True
        if self._wake_w is not None:
            with contextlib.suppress(OSError):  # full: a wake-up is already waiting
                os.write(self._wake_w, b"!")


class Remote:
    """An Interrupt from another thread for a block that holds them, before or while it
    runs (a cluster host's agent, told by the notebook, interrupts the run it hosts)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: Optional[Interrupts] = None
        self.requested = False

    def request(self) -> None:
        with self._lock:
            self.requested = True
            if self._held is not None:
                self._held.request()

    def _attach(self, interrupts: Optional[Interrupts]) -> None:
        with self._lock:
            self._held = interrupts
            if interrupts is not None and self.requested:
                interrupts.request()


@contextlib.contextmanager
def held(remote: Optional[Remote] = None) -> Iterator[Interrupts]:
    """Hold SIGINT as a flag for the block. In the main thread SIGINT sets it; in any
    thread :meth:`Interrupts.request` (or ``remote``'s) does."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    interrupts = Interrupts(wake_r, wake_w)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupts.request()) \
        if main else None
    if remote is not None:
        remote._attach(interrupts)
    try:
        yield interrupts
    finally:
        if remote is not None:
            remote._attach(None)
        if main:
            signal.signal(signal.SIGINT, previous)
        os.close(wake_r)
        os.close(wake_w)
