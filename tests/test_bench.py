"""The benchmarks still run (tiny sizes, results to a temp dir): figures are not checked here,
only that each writes its section and raw JSON. Performance is shown by bench/run.

Each runs as its script would, forked from a process that has imported torch_xla (the
``warm`` fixture: ~9 s of CPU saved a benchmark), but those of :data:`COLD`."""

import contextlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from _warm_bench import WarmRunner  # tests/ is on sys.path
from test_jax_runtime import needs_jax

BENCH = Path(__file__).resolve().parent.parent / "bench"

pytestmark = [pytest.mark.xla, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def warm():
    """Runs each benchmark as its script, forked from a process that imported torch_xla
    once (tests/_warm_bench.py)."""
    with WarmRunner() as runner:
        yield runner


# Benchmarks that measure a process importing torch (and refuse one that has): run cold.
COLD = {"torch_runtime.py"}


def run_script(warm: WarmRunner, tmp_path: Path, script: str, args) -> None:
    """``python bench/SCRIPT ARGS``, which must exit 0 (its output's ends said if not)."""
    if script in COLD:
        done = subprocess.run([sys.executable, str(BENCH / script), *args],
                              capture_output=True, text=True, timeout=280)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    code = warm.run(str(BENCH / script), list(args), str(out), str(err), timeout=280)
    assert code == 0, out.read_text()[-2000:] + err.read_text()[-2000:]


@pytest.mark.parametrize("script, args", [
    ("launch_overhead.py", ["--repeats", "2", "--warmups", "1", "--replicas", "1,2"]),
    ("output_latency.py", ["--repeats", "2", "--replicas", "2"]),
    # (one run of each view, not on a cluster: starting and stopping a local Ray cluster
    # is most of a minute, cluster.py's run below does it, and bench/run measures the
    # views on one)
    ("output_throughput.py", ["--lines", "300", "--plain-lines", "20", "--replicas", "2",
                              "--view-repeats", "1", "--targets", "one-off,session"]),
    ("start_methods.py", ["--repeats", "2", "--spawn-repeats", "2", "--replicas", "1"]),
    ("simulation.py", ["--repeats", "1", "--slow-repeats", "1", "--replicas", "1",
                       "--steps", "4"]),
    ("result_return.py", ["--mib", "2", "--replicas", "2", "--repeats", "2"]),
    ("session.py", ["--replicas", "1", "--repeats", "2", "--train-repeats", "1",
                    "--steps", "2", "--batch", "8", "--way-repeats", "2",
                    "--cpu-cells", "5"]),
    ("after_interrupt.py", ["--repeats", "1", "--loop", "10000", "--stacks", "dev"]),
    ("peers.py", ["--replicas", "1", "--repeats", "2", "--latency-repeats", "1",
                  "--throughput-replicas", "1", "--lines", "200", "--slow-lines", "10",
                  "--throughput-repeats", "1", "--return-replicas", "1", "--return-mib", "1",
                  "--return-repeats", "2", "--interrupt-replicas", "1", "--interrupts", "1",
                  "--interrupt-cap", "1", "--no-groups"]),
    ("cluster.py", ["--repeats", "2", "--latency-repeats", "1", "--interrupts", "1",
                    "--no-one-host"]),
    ("where_stopped.py", ["--replicas", "2", "--repeats", "1"]),
    ("cost_curves.py", ["--replicas", "1,2", "--repeats", "1", "--latency-repeats", "1",
                        "--interrupts", "1", "--hosts", ""]),  # (hosts: cluster.py's run)
    ("torch_runtime.py", ["--replicas", "2", "--repeats", "2", "--warmups", "0",
                          "--warm-repeats", "2", "--slow-repeats", "1", "--cold-replicas", "2"]),
    pytest.param("jax_runtime.py", ["--processes", "2", "--repeats", "2",
                                    "--latency-repeats", "1", "--interrupts", "1",
                                    "--term-cap", "0.5"],
                 marks=[pytest.mark.jax, needs_jax]),
])
def test_benchmark_runs_and_writes_its_section(tmp_path, warm, script, args):
    run_script(warm, tmp_path, script, [*args, "--out", str(tmp_path)])
    name = script[:-3]
    results = (tmp_path / "results.md").read_text()
    assert f"<!-- section:{name} -->" in results and "Machine:" in results
    assert json.loads((tmp_path / "results" / f"{name}.json").read_text())


def test_the_warm_runner_runs_a_script_as_python_would_and_kills_one_past_its_timeout(
        tmp_path, warm):
    """What run_script relies on: the script is ``__main__`` with its argv, its directory
    importable, its output in the files, its exit code and atexit handlers as ``python
    script`` gives them; one still running at the timeout is killed, with its children."""
    (tmp_path / "helper.py").write_text("WORD = 'helped'\n")
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, sys, helper
        atexit.register(lambda: print("at exit", flush=True))
        print(__name__, sys.argv[1:], helper.WORD, flush=True)
        print("to stderr", file=sys.stderr)
        if sys.argv[1] == "sleep":
            child = os.fork()
            if child == 0:
                os.execvp("sleep", ["sleep", "600"])
            open(sys.argv[2], "w").write(str(child))
            os.waitpid(child, 0)
        sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
        """))
    out, err = tmp_path / "out", tmp_path / "err"
    assert warm.run(str(script), ["3", "x"], str(out), str(err), timeout=60) == 3
    assert out.read_text() == "__main__ ['3', 'x'] helped\nat exit\n"
    assert err.read_text() == "to stderr\n"
    pid_file = tmp_path / "pid"
    with pytest.raises(TimeoutError, match="still running after 1 s"):
        warm.run(str(script), ["sleep", str(pid_file)], str(out), str(err), timeout=1)
    grandchild = int(pid_file.read_text())
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(grandchild).wait(timeout=10)  # (TimeoutExpired: it was left)
    assert not psutil.pid_exists(grandchild)  # killed with its group
    assert warm.run(str(script), ["0"], str(out), str(err), timeout=60) == 0  # it goes on


@pytest.mark.parametrize("args", [["--targets", "one-off,nowhere"], ["--targets", ","],
                                  ["--view-repeats", "0"]])
def test_output_throughput_refuses_unknown_targets_before_any_work(tmp_path, args):
    done = subprocess.run([sys.executable, str(BENCH / "output_throughput.py"), *args,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "need --targets of one-off, session, cluster, cluster-session" in done.stderr
    assert not (tmp_path / "results.md").exists()


def test_peer_groups_run_and_write_their_section(tmp_path, warm):
    """peers.py's section 6 alone (the warm groups: %xla_session, ipyparallel, nbdistributed,
    jupyter-distributed, each in a kernel of its own) at N=1, tiny sizes: its own section."""
    args = ["--only-groups", "--replicas", "1", "--group-starts", "1", "--group-repeats", "1",
            "--group-lines", "50", "--group-lines-repeats", "1", "--group-raise-repeats", "1",
            "--group-interrupts", "1", "--interrupt-cap", "2", "--group-next-deadline", "5"]
    run_script(warm, tmp_path, "peers.py", [*args, "--out", str(tmp_path)])
    results = (tmp_path / "results.md").read_text()
    assert "<!-- section:peer_groups -->" in results and "Machine:" in results
    assert "<!-- section:peers -->" not in results
    raw = json.loads((tmp_path / "results" / "peer_groups.json").read_text())
    assert [r["replicas"] for r in raw["per_n"]] == [1]
    # The session survives its Interrupt (the next cell ran, on the same processes); a
    # group with a process gone did not, whether its next cell was sent or not.
    cycles = raw["per_n"][0]["interrupt"]["runs"]
    assert all(c["survived"] and c["next_works"] for v in ("xla", "xla_widget")
               for c in cycles[v]), cycles
    for c in (c for runs in cycles.values() for c in runs):
        assert not (c["processes_gone"] and c["survived"]), c
        if c["next_text"].startswith("not sent"):
            assert c["processes_gone"] > 0 and c["next_s"] is None and not c["next_works"], c


def test_versus_measures_two_commits_in_two_kernels_and_writes_its_section(tmp_path, warm):
    """versus.py against HEAD at N=1, tiny sizes: two kernels, each importing colab_xla
    from its own tree (the benchmark checks where each imported it from), its section."""
    base = subprocess.run(["git", "-C", str(BENCH.parent), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    run_script(warm, tmp_path, "versus.py", ["--base", "HEAD", "--replicas", "1",
                                             "--repeats", "2", "--out", str(tmp_path)])
    results = (tmp_path / "results.md").read_text()
    assert "<!-- section:versus -->" in results and f"from `{base}` (" in results
    raw = json.loads((tmp_path / "results" / "versus.json").read_text())
    [n1] = raw["results"]
    assert raw["base"]["commit"] == base and n1["replicas"] == 1
    assert all(len(n1["samples_ms"][arm][cell]) == 2
               for arm in ("base", "now") for cell in ("plain", "xla", "xla_widget"))
    # The CPU each cell took in each kernel and in its session's replica (1 process): every
    # cell some in the kernel; a cell of the magic some in the replica, which ran it.
    assert n1["session_processes"] == {"base": 1, "now": 1}
    for arm, cpu in n1["cpu_ms"].items():
        assert all(len(cpu[cell][part]) == 2 for cell in cpu for part in ("kernel", "session"))
        assert all(ms > 0 for cell in cpu for ms in cpu[cell]["kernel"]), (arm, cpu)
        assert all(ms > 0 for cell in ("xla", "xla_widget")
                   for ms in cpu[cell]["session"]), (arm, cpu)
    assert sorted(n1["cpu_ms"]) == ["base", "now"]
    assert "| least wall over plain on " in results


def test_versus_says_the_goal_for_its_own_cell_only(monkeypatch):
    """The goal line (issue 35's x = 1 at N=8) is rendered for that cell, never for a
    --cell one, which measures a change; the header names the cell measured."""
    monkeypatch.syspath_prepend(str(BENCH))
    import versus
    from _results import paired, stats

    ms = {"plain": [5.0, 5.2, 5.1], "xla": [8.0, 8.4, 8.1], "xla_widget": [7.0, 7.5, 7.1]}
    cpu = {v: {"kernel": [m - 1 for m in x], "session": [1.0] * 3} for v, x in ms.items()}
    run = {"replicas": 8, "session_processes": {"base": 8, "now": 8},
           "stats": {a: {v: stats(x) for v, x in ms.items()} for a in versus.ARMS},
           "over_plain": {a: {v: paired(ms[v], ms["plain"]) for v in ("xla", "xla_widget")}
                          for a in versus.ARMS},
           "cpu_ms": {a: cpu for a in versus.ARMS}}
    base, info = {"commit": "abc1234", "subject": "s"}, {"cores_usable": 2}
    monkeypatch.setattr(versus, "machine_line", lambda *a, **k: "Machine: ...")
    goal = versus.render([run], info, base, 1.0, 3)
    assert "The cell: `x = 1`" in goal and "Goal (issue 35)" in goal
    assert "(text view): +3.0 ms (not met)" in goal
    other = versus.render([run], info, base, 1.0, 3, "a = 1\nb = 2\n", "bench/cells/two.py")
    assert "The cell: the 2 lines of `bench/cells/two.py`" in other
    assert "Goal" not in other and "not met" not in other


@pytest.mark.parametrize("content, said", [(None, "No such file"), ("\n  \n", "empty")])
def test_versus_refuses_a_cell_file_it_cannot_use_before_starting_anything(tmp_path, content,
                                                                          said):
    cell = tmp_path / "cell.py"
    if content is not None:
        cell.write_text(content)
    done = subprocess.run([sys.executable, str(BENCH / "versus.py"), "--base", "HEAD",
                           "--cell", str(cell), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"--cell {cell}: " in done.stderr and said in done.stderr
    assert not (tmp_path / "results.md").exists()


def test_schedstat_counts_the_cpu_of_every_thread_of_a_process_and_a_gone_one_as_none(
        monkeypatch):
    """The CPU figures of versus.py and torch_runtime.py (``_results.schedstat_ms``): a
    child that spins 0.2 s in a second thread (its main one waits) is counted 0.2 s more;
    one that has ended, nothing, without an error."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _results

    spin = ("import threading, time, sys\ndone = threading.Event()\n"
            "def spin():\n    end = time.thread_time() + 0.2\n"
            "    while time.thread_time() < end: pass\n"
            "    done.wait()\n"  # (alive: an ended thread's CPU leaves the count)
            "sys.stdin.readline()\nt = threading.Thread(target=spin); t.start()\n"
            "sys.stdin.readline()\ndone.set(); t.join()\n")
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, text=True)
    try:
        def on_cpu():
            return _results.schedstat_ms([child.pid])[0]

        before = on_cpu()
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = time.monotonic() + 30
        while on_cpu() - before < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        spun = on_cpu() - before
        assert 200 <= spun < 1000, spun
        child.stdin.write("end\n")
        child.stdin.flush()
        child.wait(timeout=30)
        assert on_cpu() == 0
    finally:
        child.kill()
        child.wait()


def test_versus_refuses_a_base_that_is_no_commit_before_any_work(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "versus.py"), "--base", "no-such-rev",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--base no-such-rev: not a commit here" in done.stderr
    assert not (tmp_path / "results.md").exists()


def test_memcpy_reference_is_the_faster_of_two_copies_that_both_copy(monkeypatch):
    """`_results.Memcpy`, the reference of every result-return share: each of its two ways
    copies every tensor (three over two threads: shares of unequal length), it gives the
    faster one's time, and it leaves no thread behind (one would be a foreign thread to
    the next fork of a kernel)."""
    import threading

    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    import _results

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    threads = threading.active_count()
    reference = _results.Memcpy(1 << 20, 3)
    for src, value in zip(reference.src, (7.0, 8.0, 9.0)):
        src.fill_(value)
    for way in (reference._torch_copy, reference._threads_copy):
        reference._timed(way)
        assert [float(d[0]) for d in reference._dst] == [7.0, 8.0, 9.0], way.__name__
        assert all(torch.equal(d, s) for d, s in zip(reference._dst, reference.src)), way
    seconds = reference.seconds()
    assert set(reference.ways) == {"copy_", "memmove per tensor"}
    assert seconds == min(reference.ways.values()) > 0
    assert threading.active_count() == threads


def test_memcpy_samples_keep_both_ways_and_say_each_one_s_rate(monkeypatch):
    """What the results show of the reference: each sample's two ways (not the one dict
    over again), and each way's median rate."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _results

    samples = _results.memcpy_ways(1 << 20, 2, 2)
    assert len(samples) == 2 and samples[0] is not samples[1]
    assert all(set(s) == {"copy_", "memmove per tensor"} for s in samples)
    assert _results.fastest({"copy_": 0.3, "memmove per tensor": 0.2}) == 0.2
    prose = _results.ways_prose([{"copy_": 0.1, "memmove per tensor": 0.05},
                                 {"copy_": 0.3, "memmove per tensor": 0.05}], 10**9)
    assert prose == "`copy_` 5.0, `memmove per tensor` 20.0 GB/s"


def _fake_counts(key, counts, cost, **extra):
    """cost_curves results for ``counts``: every measure's samples on ``cost(path, x)``."""
    rows = []
    for x in counts:
        stats_ms = {}
        for m in ("cell", "first_line", "every_host_first_line", "interrupt", "interrupt_clean"):
            stats_ms[m] = {}
            for path in ("one_off", "session"):
                v = cost(path, x)
                stats_ms[m][path] = {"median": v, "p10": v - 1, "p90": v + 2, "min": v - 1,
                                     "max": v + 2}
        run = {"hung": False, "ms": 50.0, "clean_ms": 50.0, "interrupted": True,
               "states": ["stopped"], "left_at_return": [], "left_after_wait": []}
        rows.append({key: x, "stats_ms": stats_ms, "hung": {"one_off": 0, "session": 0},
                     "warm_up_ms": {"one_off": 9000.0, "session": 30.0},
                     "interrupts": {"one_off": [run], "session": [run]},
                     "session_up_after": True, "session_start_s": 0.5,
                     "available_gib_session_up": 12.0, **extra})
    return rows


def test_cost_curves_fits_a_line_and_writes_out_what_a_slice_would_pay(monkeypatch, tmp_path):
    """bench/cost_curves.py's pure parts: the least-squares line, the text with a fake
    result (figures, the 64-host extrapolation said to be one), and the charts."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCH))
    import cost_curves

    line = cost_curves.fit_line([1, 2, 4, 8], [120, 140, 180, 260])
    assert line["a"] == pytest.approx(100) and line["b"] == pytest.approx(20)
    assert line["r2"] == pytest.approx(1.0) and line["points"] == 4
    assert cost_curves.fit_line([1, 2, 4], [10, None, 30])["b"] == pytest.approx(20 / 3)
    assert cost_curves.fit_line([4, 4], [1, 2]) is None  # one x: no line
    assert cost_curves.fit_line([1, 2], [None, 3]) is None

    def cost(path, x):  # one-off 100 + 50·x ms, session 20 + 5·x ms
        return 100.0 + 50 * x if path == "one_off" else 20.0 + 5 * x

    replicas = _fake_counts("replicas", [1, 2, 4], cost, session_replicas_left=[])
    hosts = _fake_counts("hosts", [1, 2, 4, 8], cost, per_host=2, connect_s=3.0,
                         replicas=0)
    cluster_run = {"nodes": 8, "nodes_start_s": 30.0, "results": hosts, "processes_seen": 9,
                   "processes_left": {}}
    fits = cost_curves.fits(hosts, "hosts", 64)
    assert fits["cell"]["session"]["value_at"] == pytest.approx(340)
    assert fits["interrupt"]["one_off"]["b"] == pytest.approx(50)

    args = argparse.Namespace(replicas="1,2,4", repeats=5, latency_repeats=3, interrupts=2,
                              hosts="1,2,4,8", per_host=2, host_repeats=4,
                              host_latency_repeats=2, host_interrupts=2, slice_hosts=64)
    info = {"cores": 2, "cores_usable": 2, "python": "3.11", "torch": "2.9", "torch_xla": "2.9",
            "date": "today", "git_commit": "abc", "colab_xla_dirty": False,
            "memory_gib": 24.0, "ray": "2.60", "matplotlib": "3.11"}
    charts = cost_curves.draw_charts(replicas, hosts, fits, str(tmp_path), 2, 2)
    assert sorted(charts) == ["hosts", "replicas"]
    assert all((tmp_path / "results" / f"cost_curves-{k}.png").stat().st_size > 1000
               for k in charts)
    text = cost_curves.render(replicas, cluster_run, info, 100.0, args, charts)
    assert "![A cell's cost by replicas](results/cost_curves-replicas.png)" in text
    assert "![A cell's cost by hosts](results/cost_curves-hosts.png)" in text
    assert "| 8 | 500 (499–502) | 60 (59–62) |" in text  # H=8: one-off, session cells
    assert "**0.34 s** for a trivial cell on its session and **3.30 s** for a one-off" in text
    assert "| trivial cell | one-off | 100 | +50.0 | 1.00 | **3.30 s** |" in text
    assert "extrapolation, from 8 hosts to 64" in text and "v5e-256" in text
    assert "Problems" not in text and "none of the 9" in text
    alone = cost_curves.render(replicas, None, info, 1.0, args, {}, no_hosts="ray is missing")
    assert "Not measured: ray is missing." in alone and "cost_curves-" not in alone


def test_the_all_reduce_goal_shows_each_runs_ratio_to_the_floor_measured_before_it(
        monkeypatch):
    """simulation.py's goal line for the 16 MiB all-reduce: besides the medians' ratio,
    each run against the floor measured right before it, and how many are within the goal
    (the machine's slow spells make some runs slow, and the median hides which)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import simulation

    said = simulation._each_run([(15.0, 10.0), (30.0, 7.5), (20.0, 10.0)], 2)
    assert said == ("; each run against the floor measured right before it: 1.50x, 4.00x, "
                    "2.00x (2 of 3 within 2x)")
    assert simulation._each_run([], 2) == ""
    n8 = {"replicas": 8, "slow_repeats": 1, "failures": [], "floor_ms": {
        "step": 10.0, "all_reduce_16m": 10.0},
        "median_ms": {m: {"step": 11.0, "all_reduce_16m": 15.0} for m in simulation.MODELS},
        "paired_16m_ms": [(15.0, 10.0)]}
    text = simulation.render([n8], simulation.machine_info(1, 1), 1.0, 1)
    assert ("within 2x of the memory-bandwidth floor: 1.50x (met); each run against the "
            "floor measured right before it: 1.50x (1 of 1 within 2x).") in text
