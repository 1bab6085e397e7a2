"""The runtime clients of a replica process: each one recorded with the call that made
it, and MegaScale discovery at most once.

A TPU runtime client (torch_xla's PJRT client, or a JAX backend: torch_xla traces its
Pallas kernels through JAX) runs MegaScale discovery, the multislice handshake, when it
starts, unless ``SKIP_MEGASCALE_PJRT_CLIENT`` is set; a second discovery in one process
hangs multislice training (pytorch/xla#8812, #8954). torch_xla sets the variable only
around its own JAX calls, and restores it after (so nested calls once popped it early).

So from a replica process's first client on, the variable stays set for the rest of the
process (process-wide: v2/v3 replicas are threads of one process, and the first client
is theirs), and every later client starts without discovery. Each client is recorded
(the library that made it, platform, call); one that would run discovery again (a TPU
client made while another exists and the variable was taken away) is refused before it
starts, with :class:`SecondDiscovery` naming its call and the first client's.

JAX is watched from the moment its ``xla_bridge`` module is imported (an import hook: no
replica pays for importing jax); torch_xla's client, made in C++, is noticed at the
replica's first ``device`` and whenever a JAX backend is about to start.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import os
import sys
import threading
import traceback
from typing import Callable, List, Optional

from ..wire.host_rank import SKIP_DISCOVERY as SKIP

# Where MegaScale exists (libtpu); other platforms' clients never run discovery.
DISCOVERING_PLATFORMS = ("tpu",)
_JAX_BRIDGE = "jax._src.xla_bridge"


class SecondDiscovery(RuntimeError):
    """A second runtime client that would run MegaScale discovery again in this process."""


@dataclasses.dataclass(frozen=True)
class Client:
    library: str  # the library that made it: torch_xla or jax
    platform: str  # "tpu", "cpu", ...
    call: str  # the call that made it: the cell's line, or where else


_clients: List[Client] = []
_lock = threading.RLock()
_where: Callable[[], str] = lambda: "outside a cell"  # noqa: E731 - set by install()


def clients() -> List[Client]:
    """The runtime clients made in this process so far, in order."""
    with _lock:
        return list(_clients)


def describe() -> str:
    """``"2 runtime clients: torch_xla's (CPU) by In[2], line 3: ...; jax's ..."``."""
    made = clients()
    return f"{len(made)} runtime client{'s' if len(made) != 1 else ''}" + (
        ": " + "; ".join(f"{c.library}'s ({c.platform.upper()}) by {c.call}" for c in made)
        if made else "")


def check(library: str, platform: str, call: str) -> None:
    """Before ``library`` starts its client for ``platform`` (made by ``call``): raise
    :class:`SecondDiscovery` if that client would run MegaScale discovery a second time."""
    with _lock:
        if (platform.lower() in DISCOVERING_PLATFORMS and os.environ.get(SKIP) != "true"
                and any(c.platform in DISCOVERING_PLATFORMS for c in _clients)):
            raise SecondDiscovery(
                f"{library} is starting a second {platform.upper()} runtime client in this "
                f"process ({call}) with {SKIP} unset, so it would run MegaScale discovery "
                f"again, which hangs multislice training (pytorch/xla#8812). This process "
                f"has {describe()}. colab_xla set {SKIP}=true when the first client "
                "started, and something in this process removed it since: find the code "
                f"that deletes or restores it (os.environ.pop('{SKIP}'), a context manager "
                "restoring the environment) and leave it set.")


def created(library: str, platform: str, call: str) -> None:
    """Record ``library``'s new client for ``platform``: every later one skips discovery."""
    with _lock:
        _clients.append(Client(library, platform.lower(), call))
        os.environ[SKIP] = "true"


def before_torch_xla() -> None:
    """Before the replica's first ``device`` (which may start torch_xla's client)."""
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is not None and not torch_xla._XLAC._xla_runtime_is_initialized():
        check("torch_xla", os.environ.get("PJRT_DEVICE", "?"), _where())


def notice_torch_xla(call: Optional[str] = None) -> None:
    """Record torch_xla's client if it exists and is not recorded yet (it is made in
    C++: this is called where it may have been)."""
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None:
        return
    with _lock:  # (replicas that are threads of one process ask at once)
        if not _made_by("torch_xla") and torch_xla._XLAC._xla_runtime_is_initialized():
            import torch_xla.runtime as xr

            created("torch_xla", xr.device_type() or "?", call or _where())


def _made_by(library: str) -> bool:
    """Whether a client ``library`` made is recorded."""
    return any(c.library == library for c in _clients)


def install(where: Callable[[], str]) -> None:
    """Watch this process's runtime clients; ``where()`` names the call being made (the
    cell's line). Idempotent."""
    global _where
    _where = where
    bridge = sys.modules.get(_JAX_BRIDGE)
    if bridge is not None:
        _watch_jax(bridge)
    elif not any(isinstance(f, _WatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WatchOnImport())


def _watch_jax(bridge) -> None:
    """Wrap JAX's backend start (``xla_bridge._init_backend``, once per platform)."""
    start = bridge._init_backend
    if getattr(start, "_colab_xla_watched", False):
        return

    def watched(platform: str):
        call = _where()
        notice_torch_xla(f"before {call}")  # made by torch_xla first: this one skips
        check("jax", platform, call)
        backend = start(platform)
        created("jax", platform, call)
        return backend

    watched._colab_xla_watched = True
    bridge._init_backend = watched


class _WatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps JAX's backend start as soon as ``jax._src.xla_bridge`` is imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _JAX_BRIDGE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _WatchingLoader(spec.loader)
                return spec
        return None


class _WatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _watch_jax(module)


def call_site(path: Optional[str], label: str) -> str:
    """The innermost line of the cell at ``path`` on this thread's stack, as ``"In[3],
    line 2: jnp.ones(3)"``; else the innermost frame outside colab_xla."""
    stack = traceback.extract_stack()[:-1]
    for frame in reversed(stack):
        if path is not None and frame.filename == path:
            return f"{label}, line {frame.lineno}: {(frame.line or '').strip()}"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for frame in reversed(stack):
        if not frame.filename.startswith(here) and "importlib" not in frame.filename:
            return f"{frame.filename}, line {frame.lineno}"
    return "outside a cell"
