"""What saying where each replica was costs an Interrupt (issue 33).

N replicas (the CPU simulation, a process each) run a cell in which replica 1 sleeps in a
function while the others wait in ``xm.rendezvous``; once every replica printed ``ready`` the
notebook's process gets SIGINT (as Jupyter's Interrupt sends it). Interrupt to clean: from
that SIGINT until ``run_cell`` returned, its processes gone. Each iteration runs it twice,
in turns: as colab_xla runs it (the replicas' stacks asked for at the cut, a byte on each
process's ask pipe: ``stacks.ask``; their answers read before the replicas are stopped:
``stacks.collect``) and with the report left out (the supervisor's ``_ask_where``
replaced by one that asks nothing), so the difference is the report's cost, paired per
iteration. The report itself: the time ``_ask_where`` and ``_where`` took in each run.
Goal: interrupt to clean within +1 s of the run without the report at 8 replicas, and the
report itself within 1 s.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from typing import Dict, List

from _results import (bench_parser, machine_info, machine_line, paired, publish,
                      replica_counts, rotated, stats)

NAME = "where_stopped"
CELL = textwrap.dedent("""
    import time
    import torch_xla.core.xla_model as xm
    def slow_load():
        time.sleep(1000)
    print('ready', flush=True)
    if index == 1:
        slow_load()
    xm.rendezvous('ready')
    """).lstrip("\n")


def measure(replicas: int, with_report: bool) -> Dict[str, float]:
    """One interrupted run: ms from SIGINT to run_cell's return, and of the report."""
    from colab_xla.notebook.outcome import RunObserver
    from colab_xla.notebook.supervisor import Supervisor
    from colab_xla.notebook.targets import run_cell

    real_ask, real_where = Supervisor._ask_where, Supervisor._where
    took: List[float] = []
    sent: List[float] = []

    def timed_ask(self):  # at the cut: the stacks asked for
        started = time.perf_counter()
        try:
            return real_ask(self) if with_report else None
        finally:
            took.append(time.perf_counter() - started)

    def timed_where(self, asked):  # before the replicas are stopped: read, and placed
        started = time.perf_counter()
        try:
            return real_where(self, asked)
        finally:
            took.append(time.perf_counter() - started)

    class InterruptWhenReady(RunObserver):
        def __init__(self):
            self.printed = set()

        def output(self, outcome, origin, lines):
            if "ready" in lines and isinstance(origin, int):
                self.printed.add(origin)
                if len(self.printed) == replicas and not sent:
                    sent.append(time.perf_counter())
                    os.kill(os.getpid(), signal.SIGINT)

    Supervisor._ask_where, Supervisor._where = timed_ask, timed_where
    try:
        outcome = run_cell(CELL, replicas=replicas, announce=None, label="Cell In[1]",
                           observer=InterruptWhenReady(), stall=0)
    finally:
        Supervisor._ask_where, Supervisor._where = real_ask, real_where
    returned = time.perf_counter()
    assert outcome.interrupted and sent, "the run was not interrupted"
    places = sum(1 for r in outcome.replicas.values() if r.error and r.error.place)
    assert places == (replicas if with_report else 0), (places, with_report)
    return {"clean_ms": (returned - sent[0]) * 1e3, "report_ms": sum(took) * 1e3}


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--replicas", default="2,8", help="replica counts (2,8)")
    parser.add_argument("--repeats", type=int, default=5, help="iterations per count (5)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    started = time.monotonic()
    rows = []
    for n in replica_counts(args.replicas):
        measure(n, True)  # warm-up (imports, the first fork)
        runs: Dict[bool, List[Dict[str, float]]] = {True: [], False: []}
        for i in range(args.repeats):
            for with_report in rotated((True, False), i):
                runs[with_report].append(measure(n, with_report))
        clean = {k: [r["clean_ms"] for r in v] for k, v in runs.items()}
        rows.append({"replicas": n, "with": stats(clean[True]), "without": stats(clean[False]),
                     "added": paired(clean[True], clean[False]),
                     "report": stats([r["report_ms"] for r in runs[True]])})
    info = machine_info(args.repeats, 1)
    seconds = time.monotonic() - started
    about = __doc__.split("\n\n", 1)[1].strip().replace("\n", " ")
    lines = ["## Where stopped replicas were: its cost to an Interrupt", "", about, "",
             "| replicas | interrupt to clean, ms | without the report, ms | added, ms "
             "(paired) | the report itself, ms |", "|---:|---:|---:|---:|---:|"]

    def ms(s):
        return f"{s['median']:.0f} ({s['p10']:.0f}–{s['p90']:.0f})"

    for row in rows:
        lines.append(f"| {row['replicas']} | {ms(row['with'])} | {ms(row['without'])} | "
                     f"{row['added']['median']:+.0f} ({row['added']['p10']:+.0f}…"
                     f"{row['added']['p90']:+.0f}) | {ms(row['report'])} |")
    last = rows[-1]
    met = last["added"]["median"] <= 1000 and last["report"]["median"] <= 1000
    lines += ["", f"Goal at {last['replicas']} replicas (interrupt to clean within +1 s, the "
              f"report within 1 s): **{'met' if met else 'not met'}** "
              f"({last['added']['median']:+.0f} ms, report {last['report']['median']:.0f} ms).",
              "", machine_line(info, NAME, seconds, f"{args.repeats} iterations after a "
                               "warm-up per count, the two ways in turns")]
    markdown = "\n".join(lines)
    return publish(NAME, markdown, {"machine": info, "rows": rows}, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
