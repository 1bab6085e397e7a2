"""Python's speed in a warm session's cells after an interrupted cell, on each users' stack.

A session cell interrupted while its replica is a thread (``--simulate threads``; TPU v2/v3)
gets KeyboardInterrupt as an asynchronous exception of that thread. Until commit b2a3a99,
every session cell's end cleared such an exception with ``PyThreadState_SetAsyncExc(thread,
NULL)``, which up to Python 3.12 leaves the interpreter's flag "an asynchronous exception is
pending" set for good: every call and loop then takes the eval loop's slow path (see
``colab_xla.replica.session._drop_async_exception``). This benchmark shows what a user's
later cells cost now, and what that call costs on each Python, in one run.

For each stack environment present (``.venv``: dev; ``.venv-colab``, ``.venv-kaggle``, which
``scripts/test`` makes), a process of that environment's Python (this checkout's colab_xla)
starts one session of 1 replica, ``--simulate threads``. Each measuring cell times, inside the
replica, ``--repeats`` loops of ``--loop`` calls of a Python function. The cells, in order:

1. the session's first cell (nothing has ended before it: the baseline);
2. a later cell (after a quiet cell's end);
3. a cell interrupted while it loops (SIGINT to that process once the cell printed, as a
   notebook's Interrupt does), which must end with ``outcome.interrupted``; then a measuring
   cell (after an interrupted cell: what colab_xla does now);
4. a cell making the call each cell's end made before b2a3a99
   (``PyThreadState_SetAsyncExc(its thread, NULL)``); then a measuring cell (the reference).

In this order, not interleaved: once set, the flag stays set for the process's life.
Reported: the median ms of each measuring cell's loops, and its ratio to the first cell's.
Writes the "after_interrupt" section of results.md and results/after_interrupt.json.

    python bench/after_interrupt.py [--repeats 5] [--loop 3000000] [--stacks dev,colab,kaggle]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _results import REPO, bench_parser, machine_info, machine_line, publish  # noqa: E402

NAME = "after_interrupt"
PROBE_TIMEOUT_S = 300

LOOP_CELL = """\
import time
def _call(x):
    return x
_times = []
for _r in range({repeats}):
    _t = time.perf_counter()
    for _i in range({loop}):
        _call(_i)
    _times.append((time.perf_counter() - _t) * 1e3)
_times
"""
INTERRUPTED_CELL = "print('looping', flush=True)\nwhile True:\n    pass\n"
OLD_CALL_CELL = ("import ctypes, threading\n"
                 "ctypes.pythonapi.PyThreadState_SetAsyncExc("
                 "ctypes.c_ulong(threading.get_ident()), None)\n")
GROUPS = ("first", "later", "after_interrupt", "after_old_call")


def stack_pythons(names: List[str]) -> Dict[str, Optional[str]]:
    """Each stack's Python: ``.venv`` for dev, ``.venv-NAME`` for a users' stack; None if
    that environment is not there."""
    found = {}
    for name in names:
        venv = os.path.join(REPO, ".venv" if name == "dev" else f".venv-{name}")
        python = os.path.join(venv, "bin", "python")
        found[name] = python if os.path.exists(python) else None
    return found


def measure_stack(python: str, args) -> dict:
    """Run the probe under ``python``; its figures (a failure raises, with its output)."""
    env = dict(os.environ, PYTHONPATH=REPO, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    done = subprocess.run([python, os.path.abspath(__file__), "--probe",
                           "--repeats", str(args.repeats), "--loop", str(args.loop)],
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env,
                          cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{python}: exit {done.returncode}\n{done.stdout[-2000:]}"
                           f"\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the probe: runs in the stack's Python ----------------------------------------------------

def probe(args) -> dict:
    import colab_xla
    from colab_xla.notebook.outcome import RunObserver
    from colab_xla.notebook.targets import run_cell
    from colab_xla.notebook.targets.session import SessionOptions, new_session

    class InterruptOnOutput(RunObserver):
        """SIGINT to this process once the cell printed (it is in its loop by then)."""

        def __init__(self):
            self.fired = False

        def output(self, outcome, origin, lines) -> None:
            if lines and not self.fired:
                self.fired = True
                threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT)).start()

    def cell(source: str, observer: Optional[RunObserver] = None):
        return run_cell(source, session=session, announce=None, timeout=120,
                        observer=observer)

    def loops() -> List[float]:
        outcome = cell(LOOP_CELL.format(repeats=args.repeats, loop=args.loop))
        if not outcome.ok:
            raise RuntimeError(f"a loop cell failed: {outcome.replicas}")
        return [float(ms) for ms in outcome.results()[0]]

    session = new_session(SessionOptions(replicas=1, simulate="threads"), {}, announce=None)
    try:
        result = {"python": platform.python_version(),
                  "colab_xla": os.path.dirname(colab_xla.__file__)}
        result["first"] = loops()
        result["later"] = loops()
        observer = InterruptOnOutput()
        outcome = cell(INTERRUPTED_CELL, observer)
        if not (observer.fired and outcome.interrupted):
            raise RuntimeError(f"the cell to interrupt was not interrupted: {outcome.replicas}")
        result["after_interrupt"] = loops()
        outcome = cell(OLD_CALL_CELL)
        if not outcome.ok:
            raise RuntimeError(f"the old call's cell failed: {outcome.replicas}")
        result["after_old_call"] = loops()
    finally:
        session.stop()
    return result


# --- the report ---------------------------------------------------------------------------

def report(figures: Dict[str, Optional[dict]], args, seconds: float, info: dict) -> str:
    rows = []
    for name, found in figures.items():
        if found is None:
            env = ".venv" if name == "dev" else f".venv-{name}"
            rows.append(f"| {name} | – | not measured: no `{env}` (`scripts/test` makes it) "
                        "| | | |")
            continue
        med = {group: statistics.median(found[group]) for group in GROUPS}
        cells = " | ".join(f"{med[group]:.1f} ({med[group] / med['first']:.2f}x)"
                           for group in GROUPS[1:])
        rows.append(f"| {name} | {found['python']} | {med['first']:.1f} | {cells} |")
    return (
        "## A session's later cells, after an interrupted cell\n\n"
        f"A session of 1 replica thread (`--simulate threads`: its interrupts are asynchronous "
        f"exceptions), in each stack's Python. Each measuring cell times, in the replica, "
        f"{args.repeats} loops of {args.loop:,} calls of a Python function: ms, median of its "
        "loops (over the first cell's). The cells, in this order: the session's first; a later "
        "one; one after a cell interrupted while it looped (what colab_xla does now); one "
        "after a cell that makes the call each session cell's end made before commit b2a3a99, "
        "`PyThreadState_SetAsyncExc(thread, NULL)` (the reference).\n\n"
        "| stack | Python | first cell ms | a later cell ms | after an interrupted cell ms "
        "| after the old call ms |\n"
        "|---|---|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        "Up to Python 3.12 the old call leaves the interpreter's flag \"an asynchronous "
        "exception is pending\" set, as only an exception taken clears it: every call and "
        "loop of every thread then takes the eval loop's slow path, for the process's life "
        "(and on 3.11, a cell that sets and clears a profiler spins). Now a cell's end sends "
        "nothing unless the cell was interrupted, and then replaces what may be pending by "
        "an exception it takes at once (`_drop_async_exception`). Not interleaved: the flag, "
        "once set, stays set, so the cells run in order, in one process per stack.\n\n"
        + machine_line(info, NAME, seconds,
                       f"{args.repeats} loops per cell; one process per stack")
    )


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="loops per measuring cell (5)")
    parser.add_argument("--loop", type=int, default=3_000_000,
                        help="calls in each timed cell's loop (3,000,000)")
    parser.add_argument("--stacks", default="dev,colab,kaggle",
                        help="stacks to measure, those present (dev,colab,kaggle)")
    # The process each stack's Python runs (it prints its figures as JSON).
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.loop < 1:
        parser.error("--repeats and --loop must be >= 1")
    if args.probe:
        print(json.dumps(probe(args)))
        return 0
    started = time.monotonic()
    figures: Dict[str, Optional[dict]] = {}
    for name, python in stack_pythons([s for s in args.stacks.split(",") if s]).items():
        print(f"after_interrupt: {name}: {python or 'absent'}", file=sys.stderr)
        figures[name] = measure_stack(python, args) if python else None
    if not any(figures.values()):
        parser.error(f"none of the stacks {args.stacks} has an environment here: scripts/env "
                     "makes .venv (dev), scripts/test the users' stacks too")
    info = machine_info(args.repeats, 0)
    markdown = report(figures, args, time.monotonic() - started, info)
    return publish(NAME, markdown, {"machine": info, "loop": args.loop, "stacks": figures},
                   out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
