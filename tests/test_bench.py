"""The benchmarks still run (tiny sizes, results to a temp dir): figures are not checked here,
only that each writes its section and raw JSON. Performance is shown by bench/run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_jax_runtime import needs_jax  # tests/ is on sys.path

BENCH = Path(__file__).resolve().parent.parent / "bench"

pytestmark = [pytest.mark.xla, pytest.mark.timeout(300)]


@pytest.mark.parametrize("script, args", [
    ("launch_overhead.py", ["--repeats", "2", "--warmups", "1", "--replicas", "1,2"]),
    ("output_latency.py", ["--repeats", "2", "--replicas", "2"]),
    ("output_throughput.py", ["--lines", "300", "--plain-lines", "20", "--replicas", "2"]),
    ("start_methods.py", ["--repeats", "2", "--spawn-repeats", "2", "--replicas", "2"]),
    ("simulation.py", ["--repeats", "1", "--replicas", "2", "--steps", "4"]),
    ("result_return.py", ["--mib", "2", "--replicas", "2", "--repeats", "2"]),
    ("session.py", ["--replicas", "2", "--repeats", "2", "--train-repeats", "1",
                    "--steps", "2", "--batch", "8"]),
    ("after_interrupt.py", ["--repeats", "1", "--loop", "10000", "--stacks", "dev"]),
    ("peers.py", ["--replicas", "2", "--repeats", "2", "--latency-repeats", "1",
                  "--throughput-replicas", "2", "--lines", "200", "--slow-lines", "10",
                  "--throughput-repeats", "1", "--return-replicas", "2", "--return-mib", "1",
                  "--return-repeats", "2", "--interrupt-replicas", "2", "--interrupts", "1",
                  "--interrupt-cap", "1"]),
    ("cluster.py", ["--repeats", "2", "--latency-repeats", "1", "--interrupts", "1",
                    "--no-one-host"]),
    ("where_stopped.py", ["--replicas", "2", "--repeats", "1"]),
    ("torch_runtime.py", ["--replicas", "2", "--repeats", "2", "--warmups", "0",
                          "--warm-repeats", "2", "--slow-repeats", "1", "--cold-replicas", "2"]),
    pytest.param("jax_runtime.py", ["--processes", "2", "--repeats", "2",
                                    "--latency-repeats", "1", "--interrupts", "1",
                                    "--term-cap", "0.5"],
                 marks=[pytest.mark.jax, needs_jax]),
])
def test_benchmark_runs_and_writes_its_section(tmp_path, script, args):
    done = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    name = script[:-3]
    results = (tmp_path / "results.md").read_text()
    assert f"<!-- section:{name} -->" in results and "Machine:" in results
    assert json.loads((tmp_path / "results" / f"{name}.json").read_text())


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
