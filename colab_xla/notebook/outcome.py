"""What a run produced, as plain data: per-replica outcomes, errors, and their grouping.

Everything here crosses process boundaries or is rendered by a view, so it is made of
plain values (strings, numbers, bytes) and imports neither IPython nor torch.

Example::

    >>> err = ReplicaError("exception", "ValueError", "boom", "Traceback ...\\nValueError: boom\\n")
    >>> outcome = RunOutcome(device_type="CPU", replicas={
    ...     0: ReplicaOutcome(0, state="done"),
    ...     1: ReplicaOutcome(1, state="failed", error=err)})
    >>> [ordinals for _, ordinals in outcome.error_groups()]
    [[1]]
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from ..wire import stacks
from ..wire.reports import RETURN_PLAIN_DATA, ReplicaError
from ..wire.values import load_value
from .output_log import OutputLog

# A replica's life: running until its report arrives, then exactly one of the others.
RUNNING, DONE, FAILED, STOPPED = "running", "done", "failed", "stopped"


@dataclasses.dataclass
class ReplicaOutcome:
    """One replica as the notebook sees it: state, output, result, error, time."""

    ordinal: int
    state: str = RUNNING
    pid: Optional[int] = None
    elapsed: Optional[float] = None
    log: OutputLog = dataclasses.field(default_factory=lambda: OutputLog(None))
    has_value: bool = False
    value: Any = None
    value_repr: Optional[str] = None
    error: Optional[ReplicaError] = None
    last_rendezvous: Optional[str] = None  # tag of the last xm.rendezvous it entered
    pulled: Dict[str, Any] = dataclasses.field(default_factory=dict)  # --pull: name -> value
    # Its tqdm bars still open, by bar (colab_xla.replica.progress): count, total,
    # description, the text line; and a count of their changes, for the views.
    progress: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)
    progress_changes: int = 0

    @property
    def text(self) -> str:
        """The replica's output lines (the last ones kept), stdout and stderr in order."""
        return self.log.tail_text()

    def pulled_summary(self) -> Optional[str]:
        """``"model (Net), step (int)"``: the ``--pull`` names that arrived, or None."""
        if not self.pulled:
            return None
        return ", ".join(f"{n} ({type(v).__name__})" for n, v in self.pulled.items())


@dataclasses.dataclass
class RunOutcome:
    """A whole ``%%xla_spawn`` run: one :class:`ReplicaOutcome` per replica ordinal."""

    device_type: str
    replicas: Dict[int, ReplicaOutcome] = dataclasses.field(default_factory=dict)
    # The wall time the person waited: from :attr:`began` to the run's end (the replicas'
    # start-up included; each replica's own time is its ``elapsed``). None while it runs.
    elapsed: Optional[float] = None
    # When the cell asked to run (the magic's start), in this process's time.monotonic().
    began: float = dataclasses.field(default_factory=time.monotonic)
    interrupted: bool = False
    # Output no single replica owns (C-level writes of a process running several replicas,
    # its threads no replica started), by process label such as "process 0".
    processes: Dict[str, OutputLog] = dataclasses.field(default_factory=dict)
    log_dir: Optional[str] = None  # where the full logs are
    # Why no replica started at all: xmp.spawn itself failed (a device this machine does
    # not have, a broken torch_xla), as kind "launch"; or a session's cell could not be
    # sent to its replicas, as kind "unsent". None when replicas started.
    launch_error: Optional[ReplicaError] = None
    # Run on a session (colab_xla.notebook.targets.session) that ended during the cell: why;
    # else None.
    session_ended: Optional[str] = None
    # Run on a cluster (colab_xla.notebook.cluster): each replica's host, by global ordinal.
    hosts: Dict[int, int] = dataclasses.field(default_factory=dict)
    # Run on a cluster whose connection ended during the cell (a host gone): why; else None.
    cluster_ended: Optional[str] = None
    # Run on some of a session's replicas (--targets): the others, idle; else empty.
    idle: List[int] = dataclasses.field(default_factory=list)
    # The notebook name ``-o`` put the results in (None: no -o, or it kept its value), and
    # the ``-o``/``--pull`` names that kept their earlier value (``"-o res"``: no replica
    # sent a new one); set once the values are stored, for the views' headline.
    stored_as: Optional[str] = None
    kept: List[str] = dataclasses.field(default_factory=list)

    def label(self, ordinal: int) -> str:
        """``"replica 3"``, or on a cluster ``"host 1 · replica 3"``."""
        host = self.hosts.get(ordinal)
        return f"replica {ordinal}" if host is None else f"host {host} · replica {ordinal}"

    def replica(self, ordinal: int) -> ReplicaOutcome:
        if ordinal not in self.replicas:
            self.replicas[ordinal] = ReplicaOutcome(ordinal,
                                                    log=self._new_log(f"replica-{ordinal}"))
        return self.replicas[ordinal]

    def process(self, label: str) -> OutputLog:
        if label not in self.processes:
            self.processes[label] = self._new_log(label.replace(" ", "-"))
        return self.processes[label]

    @property
    def logged(self) -> bool:
        """Whether a line of the run is in a log file of :attr:`log_dir` (made then)."""
        return bool(self.log_dir) and any(
            log.written for log in (*(r.log for r in self.replicas.values()),
                                    *self.processes.values()))

    @property
    def cut(self) -> bool:
        """Whether some replica's output is longer than a view shows of it: only then do
        the views point at the full logs of :attr:`log_dir`."""
        return self.logged and any(
            log.truncated for log in (*(r.log for r in self.replicas.values()),
                                      *self.processes.values()))

    def _new_log(self, name: str) -> OutputLog:
        return OutputLog(f"{self.log_dir}/{name}.log" if self.log_dir else None)

    @property
    def failed(self) -> List[int]:
        """Replicas that failed by themselves (raised, exited non-zero, died)."""
        return sorted(o for o, r in self.replicas.items() if r.state == FAILED)

    @property
    def stopped(self) -> List[int]:
        """Replicas the run stopped: Interrupt, ``--timeout``, or another replica failed."""
        return sorted(o for o, r in self.replicas.items() if r.state == STOPPED)

    @property
    def ok(self) -> bool:
        return (bool(self.replicas) and not self.interrupted and self.launch_error is None
                and all(r.error is None for r in self.replicas.values()))

    def results(self) -> Dict[int, Any]:
        """``{ordinal: value}`` of the replicas whose value arrived, sorted by ordinal."""
        return {o: r.value for o, r in sorted(self.replicas.items()) if r.has_value}

    def pulled(self, name: str) -> Dict[int, Any]:
        """``{ordinal: value}`` of ``--pull`` name ``name``, from the replicas it came from."""
        return {o: r.pulled[name] for o, r in sorted(self.replicas.items()) if name in r.pulled}

    def error_groups(self) -> List[Tuple[ReplicaError, List[int]]]:
        """Each distinct error once, with the sorted ordinals of the replicas that hit it."""
        groups: Dict[Tuple[str, str], Tuple[ReplicaError, List[int]]] = {}
        for ordinal in self.failed + self.stopped:
            error = self.replicas[ordinal].error
            shared = dataclasses.replace(error, where="", place="")  # (each replica's own)
            key = (shared.kind, shared.render())
            groups.setdefault(key, (shared, []))[1].append(ordinal)
        return list(groups.values())

    def places(self, ordinals) -> List[str]:
        """Where replicas ``ordinals`` were when the run was cut, those at the same place
        together: ``["replicas 0, 1, 3 at line 7: `xm.rendezvous('ready')` (in ...)"]``."""
        return self.place_lines({o: self.replicas[o].error.place for o in ordinals
                                 if self.replicas[o].error is not None
                                 and self.replicas[o].error.place})

    def place_lines(self, places: Mapping[int, str]) -> List[str]:
        """``{ordinal: place}`` said with the replicas at one place together."""
        def who(at: List[int]) -> str:
            if any(o in self.hosts for o in at):
                return ", ".join(self.label(o) for o in at)
            return f"{'replica' if len(at) == 1 else 'replicas'} {format_ordinals(at)}"

        return [f"{who(at)} at {place}" for place, at in stacks.grouped(places)]


def fraction(bar: Mapping[str, Any]) -> Optional[float]:
    """How far a progress bar is, 0 to 1 (None: it has no total)."""
    total, n = bar.get("total"), bar.get("n") or 0
    return min(1.0, max(0.0, n / total)) if total else None


@dataclasses.dataclass(frozen=True)
class Stall:
    """No replica has printed for ``quiet`` seconds; where each one still running is
    (``places``: ordinal -> place, :func:`colab_xla.wire.stacks.place`)."""

    quiet: float
    places: Mapping[int, str]

    def notice(self, outcome: RunOutcome) -> str:
        """What a view shows: a line, then the replicas at each place."""
        idle = []
        if outcome.idle:  # (a collective waits for every replica: these never come)
            one = len(outcome.idle) == 1
            idle = [f"{'replica' if one else 'replicas'} {format_ordinals(outcome.idle)} "
                    f"{'does' if one else 'do'} not run this cell (--targets): a collective "
                    f"in it waits for {'it' if one else 'them'} forever"]
        return "\n".join([f"No output for {self.quiet:.0f} s; where each replica is now:",
                          *outcome.place_lines(self.places), *idle])


class RunObserver:
    """Hooks a live view implements, all called in the thread that called run_cell.

    ``origin`` of output is a replica ordinal, or a process label ("process 0") for output
    no single replica owns; ``lines`` are the lines it completed (``\\r`` collapsed).
    ``tick`` is when views draw: at once after output, unless the last draw was less than
    an interval ago (``colab_xla.notebook.draw_pacing.NEXT_DRAW_SECONDS``, doubling while
    output keeps waiting, up to ``TICK_SECONDS``, a quarter second); without output, every
    ``TICK_SECONDS``.
    ``closed`` is not called by :func:`run_cell`: whoever called it calls ``closed`` once
    it has used the outcome (the magic stores ``-o`` and ``--pull`` values first, so a
    view that fails while drawing the end cannot lose them).
    """

    def opened(self, outcome: RunOutcome) -> None: ...

    def started(self, outcome: RunOutcome, ordinal: int) -> None: ...

    def output(self, outcome: RunOutcome, origin, lines: List[str]) -> None: ...

    def finished(self, outcome: RunOutcome, ordinal: int) -> None: ...

    def tick(self, outcome: RunOutcome) -> None: ...

    def stalled(self, outcome: RunOutcome, stall: Optional["Stall"]) -> None:
        """No replica has printed for ``--stall`` seconds: ``stall`` says where each is
        (told again while it lasts); None once output comes again (the notice goes)."""

    def closed(self, outcome: RunOutcome) -> None: ...


def counted(n: int, word: str) -> str:
    """``"1 replica"``, ``"4 replicas"``."""
    return f"{n} {word}{'s' if n != 1 else ''}"


def format_ordinals(ordinals: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: compact replica lists for headings."""
    ordinals = sorted(set(ordinals))
    spans: List[str] = []
    start = prev = None
    for o in ordinals + [None]:
        if start is not None and (o is None or o != prev + 1):
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if o is not None and start is None:
            start = o
        prev = o
    return ", ".join(spans)


class XlaSpawnError(Exception):
    """Raised in the notebook when replicas of a run failed.

    The message shows each distinct traceback once, headed by the replicas that hit it,
    so Run All stops at this cell. ``outcome`` holds the whole :class:`RunOutcome`
    (results of the replicas that succeeded included).
    """

    # IPython draws at most this many distinct tracebacks; the rest are counted.
    max_tracebacks = 4

    def __init__(self, outcome: RunOutcome):
        self.outcome = outcome
        super().__init__(self.summary())

    def summary(self) -> str:
        """e.g. ``1 of 4 replicas failed (ValueError); 3 were stopped (Stopped)``."""
        out = self.outcome
        total = counted(len(out.replicas), "replica")

        def kinds(ordinals):
            return ", ".join(sorted({out.replicas[o].error.ename for o in ordinals}))

        parts = []
        error = out.launch_error
        if error is not None and error.kind == "unsent":
            parts.append(f"the cell could not be sent to the session's replicas ({error.ename}: "
                         f"{error.evalue}): none ran it, and the session is still up; run "
                         "the cell again (%xla_session restart if this comes again)")
        elif error is not None:
            parts.append(f"the replicas could not be started ({error.ename}: {error.evalue}): "
                         "xmp.spawn failed before any replica ran; the traceback below says "
                         "where (a PJRT_DEVICE this torch_xla cannot start, a broken install)")
        if out.failed:
            parts.append(f"{len(out.failed)} of {total} failed ({kinds(out.failed)})")
        if out.stopped:
            were = "was" if len(out.stopped) == 1 else "were"
            of = "" if out.failed else f" of {total}"
            parts.append(f"{len(out.stopped)}{of} {were} stopped ({kinds(out.stopped)})")
        return "; ".join(parts)

    def render(self) -> str:
        """The error as IPython shows it: the summary, then each distinct traceback."""
        return f"XlaSpawnError: {self}"

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.outcome.launch_error is not None and self.outcome.launch_error.traceback:
            lines += ["", self.outcome.launch_error.render()]
        groups = self.outcome.error_groups()
        for error, ordinals in groups[: self.max_tracebacks]:
            noun = "replica" if len(ordinals) == 1 else "replicas"
            lines.append("")
            lines.append(f"[{noun} {format_ordinals(ordinals)}]")
            lines.append(error.render())
            lines += [f"  {line}" for line in self.outcome.places(ordinals)]
            for o in ordinals:
                where = self.outcome.replicas[o].error.where
                if where:
                    lines.append(f"  replica {o}: {where}")
        if len(groups) > self.max_tracebacks:
            rest = groups[self.max_tracebacks:]
            lines.append("")
            lines.append(f"... and {len(rest)} more distinct errors on replicas "
                         f"{format_ordinals(o for _, os_ in rest for o in os_)}; "
                         "see `.outcome` of this exception.")
        return "\n".join(lines)

    def _render_traceback_(self) -> List[str]:
        # IPython calls this instead of printing our own (uninteresting) kernel-side frames.
        return self.render().splitlines()


def interrupted_error() -> KeyboardInterrupt:
    """The KeyboardInterrupt an interrupted cell ends with (Run All stops there), shown by
    IPython as one line: where each replica stopped is said above it, and IPython's
    traceback of the magic's own frames said nothing more while it took ~20 ms of the
    Interrupt's reply (1 s the first time, as it read the magic's source)."""
    exc = KeyboardInterrupt()
    exc._render_traceback_ = lambda: [INTERRUPTED]  # type: ignore[attr-defined]
    return exc


INTERRUPTED = "KeyboardInterrupt: the cell was interrupted; where each replica stopped is above"


def load_results(rep: ReplicaOutcome, value: Optional[bytes], pulled: Mapping[str, bytes],
                 notebook_ns: Mapping[str, Any]) -> None:
    """In the notebook: replica ``rep``'s packed value and ``--pull`` names loaded into
    it; what cannot be loaded becomes its error (a ResultError, with the replica's own
    error after it, if any)."""
    problems = []
    if value is not None:
        try:
            rep.value, rep.has_value = load_value(value, notebook_ns), True
        except Exception as exc:  # noqa: BLE001
            problems.append(f"the cell's value arrived but could not be loaded in the "
                            f"notebook: {type(exc).__name__}: {exc}")
    for name, data in pulled.items():
        try:
            rep.pulled[name] = load_value(data, notebook_ns)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"--pull {name} arrived but could not be loaded in the "
                            f"notebook: {type(exc).__name__}: {exc}")
    if problems:  # with what the replica itself could not send, if anything
        rest = f"; {rep.error.evalue}" if rep.error else ". " + RETURN_PLAIN_DATA
        rep.error = ReplicaError("result", "ResultError", "; ".join(problems) + rest)
