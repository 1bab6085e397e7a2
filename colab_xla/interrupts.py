"""The notebook's Interrupt (SIGINT) as a flag that colab_xla checks, never an exception
raised wherever the kernel's main thread happens to be.

While a run goes on, the main thread also draws the live view, sending widget messages
through ipykernel and pyzmq. With the Interrupt raised as a KeyboardInterrupt wherever the
main thread was, a 500-run soak test saw about one in 20 interrupted widget runs lose it (the
cell ran on, the main thread back in its select); where it was swallowed was not found, and
a flag cannot be swallowed. And an import of torch or torch_xla cut half-way
leaves half-initialized modules in ``sys.modules`` for the kernel's life. So within :func:`held`, SIGINT only sets
:attr:`Interrupts.requested` (and wakes a ``select`` on :attr:`Interrupts.wake_fd`); the
code that holds it decides where to stop.

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
    """Whether SIGINT came while held; ``wake_fd`` becomes readable when it does."""

    def __init__(self, wake_fd: Optional[int]):
        self.requested = False
        self.wake_fd = wake_fd

    def raise_if_requested(self) -> None:
        if self.requested:
            raise KeyboardInterrupt


@contextlib.contextmanager
def held() -> Iterator[Interrupts]:
    """Hold SIGINT as a flag for the block (in the main thread; elsewhere signals do not
    arrive, and the flag stays False)."""
    if threading.current_thread() is not threading.main_thread():
        yield Interrupts(None)
        return
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    interrupts = Interrupts(wake_r)

    def note(signum, frame):
        interrupts.requested = True
        with contextlib.suppress(OSError):  # full: a wake-up is already waiting
            os.write(wake_w, b"!")

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous)
        os.close(wake_r)
        os.close(wake_w)
