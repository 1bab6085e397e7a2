"""What is asked of colab_xla, as one value made where it is asked (the magic's line,
``run_cell``'s keywords, a cluster host's agent) and handed down unchanged:

* :class:`CellRequest`: a cell to run (its parse, the notebook's names, the options);
* :class:`LaunchAsked`: how its replicas should start, as asked (None: not asked);
* :class:`SessionRequest`: what ``%xla_session start`` asks.

Nothing here decides where a cell runs or what its options mean there: a target does
(:mod:`colab_xla.notebook.targets`), and refuses what it cannot give.

Example::

    >>> from colab_xla.wire.cell import Cell
    >>> request = CellRequest(Cell("index * 10"), replicas=2, env={"XLA_IR_DEBUG": "1"})
    >>> request.replica_flags_asked()
    ['-n', '--env']
    >>> request.launch.one_off().describe()
    'fork'
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Tuple

from ..errors import OptionError
from ..wire.cell import Cell
from .defaults import Defaults
from .chosen import Chosen
from .interrupts import Remote
from .launch import Launch

# Seconds without output after which the live view says where each replica is (--stall).
DEFAULT_STALL_SECONDS = 60.0


@dataclass(frozen=True)
class LaunchAsked:
    """How a cell's replicas should start, as asked: None (or the launcher's default,
    ``xmp``) is not asked, and the target's own is used (a one-off run's: fork, or
    ``default_start_method``; a session's: what it was started with)."""

    start_method: Optional[str] = None
    launcher: str = "xmp"
    debug_single: bool = False
    runtime: Optional[str] = None
    devices_per_process: Optional[int] = None
    default_start_method: str = "fork"  # a one-off run's, if not asked

    @classmethod
    def of(cls, launch: Optional[Launch]) -> "LaunchAsked":
        """Every part of ``launch`` asked (None: nothing asked)."""
        if launch is None:
            return cls()
        return cls(launch.start_method, launch.launcher, launch.debug_single, launch.runtime,
                   launch.devices_per_process)

    @property
    def any_asked(self) -> bool:
        """Whether any part of the launch is asked."""
        return bool(self.start_method or self.launcher != "xmp" or self.debug_single
                    or self.runtime or self.devices_per_process is not None)

    def one_off(self) -> Launch:
        """The launch of a one-off run (an :class:`~colab_xla.errors.OptionError` for one it
        cannot make: --runtime jax with --debug-single, a start method that is none)."""
        return Launch(self.start_method or self.default_start_method, launcher=self.launcher,
                      debug_single=self.debug_single, runtime=self.runtime,
                      devices_per_process=self.devices_per_process)

    def within(self, own: Launch) -> Optional[Launch]:
        """The launch asked, ``own`` giving what is not asked; None if nothing is."""
        if not self.any_asked:
            return None
        return Launch(self.start_method or own.start_method, launcher=self.launcher,
                      debug_single=self.debug_single, runtime=self.runtime or own.runtime,
                      devices_per_process=self.devices_per_process)


@dataclass(frozen=True)
class CellRequest:
    """A cell to run and how (None, empty: not asked; the target's own is used).

    ``cell`` is its one parse; ``user_ns`` the notebook's names (read, never changed);
    ``replicas``, ``launch``, ``env`` (for the replicas only), ``cache_dir`` and
    ``simulate`` say what replicas to run it on; ``timeout``, ``stall``, ``pull`` and
    ``pull_from`` what the run does; ``targets`` the replicas of a session that run it
    (None: all of them; ``--targets``); ``announce`` says what a person should know before it
    starts (None: nothing is said); ``hosted`` makes it a run a cluster host's agent runs
    for the notebook (:mod:`colab_xla.notebook.cluster.agent`); ``defaults`` are the environment's
    (:mod:`colab_xla.notebook.defaults`), read once, when the request is made; ``began`` is
    when the cell asked to run (``time.monotonic()``; the magic's start): the run's time
    counts from there, its planning and the replicas' start-up included.
    """

    cell: Cell
    user_ns: Mapping[str, Any] = field(default_factory=dict)
    replicas: Optional[int] = None
    launch: LaunchAsked = LaunchAsked()
    env: Mapping[str, str] = field(default_factory=dict)
    cache_dir: Optional[str] = None
    simulate: Optional[str] = None
    timeout: Optional[float] = None
    stall: Optional[float] = DEFAULT_STALL_SECONDS
    pull: Tuple[str, ...] = ()
    pull_from: Optional[int] = None
    targets: Optional[Chosen] = None
    announce: Optional[Callable[[str], Any]] = print
    hosted: Optional[Remote] = None
    defaults: Defaults = field(default_factory=Defaults.read)
    began: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        if self.stall is not None and not (self.stall >= 0 and math.isfinite(self.stall)):
            raise OptionError(f"--stall {self.stall:g}: the seconds without output must be 0 "
                              "(never) or more.")

    def replica_flags_asked(self) -> List[str]:
        """The options that choose the replicas which this request asks, as a line names
        them (a target that has its own refuses them by these names)."""
        launch = self.launch
        return [flag for flag, given in (
            ("-n", self.replicas is not None), ("--start-method", launch.start_method),
            ("--launcher", launch.launcher != "xmp"), ("--debug-single", launch.debug_single),
            ("--runtime", launch.runtime),
            ("--devices-per-process", launch.devices_per_process is not None),
            ("--env", self.env), ("--cache", self.cache_dir), ("--simulate", self.simulate))
            if given]


@dataclass(frozen=True)
class SessionRequest:
    """What ``%xla_session start`` asks, as the line gives it (None, empty: not asked).
    ``env`` stays as given (``KEY=VALUE``): on a cluster it is refused before it is read."""

    replicas: Optional[int] = None
    start_method: Optional[str] = None
    simulate: Optional[str] = None
    env: Tuple[str, ...] = ()
    cache_dir: Optional[str] = None
    runtime: Optional[str] = None
    devices_per_process: Optional[int] = None
    defaults: Defaults = field(default_factory=Defaults.read)

    def given(self) -> List[str]:
        """The options given, as the line names them."""
        return [flag for flag, value in (
            ("-n", self.replicas is not None), ("--start-method", self.start_method),
            ("--simulate", self.simulate), ("--env", self.env), ("--cache", self.cache_dir),
            ("--runtime", self.runtime),
            ("--devices-per-process", self.devices_per_process is not None)) if value]
