"""The CPU simulation's two models through real runs: one process per replica (the default,
like a TPU v4 or later host) and threads of one process (``--simulate threads``, like v2/v3).
What a replica sees of the runtime, what it owns alone, and how a replica whose process
dies ends the run; and that a replica process listens on loopback alone."""

import json
import os
from importlib.metadata import version

import pytest

from _listeners import LISTENING, not_loopback, run_with_hostname_elsewhere
from _runs import run

pytestmark = [pytest.mark.xla, pytest.mark.timeout(300), pytest.mark.stacks("colab", "kaggle")]

IDENTITY = '''
import os, torch_xla, torch_xla.runtime as xr, torch_xla.core.xla_model as xm
(os.getpid(), xr.world_size(), xr.global_ordinal(), xr.local_ordinal(), xr.process_index(),
 xr.process_count(), xr.local_process_count(), xr.addressable_device_count(),
 xr.global_device_count(), xm.is_master_ordinal(), xm.is_master_ordinal(local=False),
 str(device))
'''


def _ok(outcome):
    assert outcome.ok, ({o: r.error.render() for o, r in outcome.replicas.items() if r.error},
                        {label: log.tail_text()[-4000:]
                         for label, log in outcome.processes.items()})
    return outcome.results()


def test_each_replica_is_a_process_that_answers_as_its_replica_on_a_tpu_host():
    n = 4
    results = _ok(run(IDENTITY, n))
    assert len({pid for pid, *_ in results.values()}) == n  # a process each
    assert os.getpid() not in {pid for pid, *_ in results.values()}
    for o, (_, *identity) in results.items():
        # as on a v4-8 host: a process per chip, one device each, all local
        assert identity == [n, o, o, o, n, n, 1, n, o == 0, o == 0, "xla:0"], o


def test_threads_keep_the_v2_v3_host_answers():
    n = 4
    results = _ok(run(IDENTITY, n, simulate="threads"))
    assert len({pid for pid, *_ in results.values()}) == 1  # one process
    for o, (_, world, ordinal, local, *_rest, device) in results.items():
        assert (world, ordinal, local, device) == (n, o, o, f"xla:{o}")


def test_a_seed_set_in_the_cell_gives_every_replica_the_same_model():
    # Replicas that were threads shared one generator: the same seed gave each replica
    # different numbers, so data-parallel replicas trained different models.
    cell = '''
    import torch
    torch.manual_seed(0)
    first = torch.nn.Linear(3, 2).weight.detach().clone()
    torch.manual_seed(index)
    (first, torch.rand(2))
    '''
    results = _ok(run(cell, 4))
    firsts = [first for first, _ in results.values()]
    assert all((f == firsts[0]).all() for f in firsts)
    own = [tuple(r.tolist()) for _, r in results.values()]
    assert len(set(own)) == 4  # seeded with its ordinal: its own numbers


def test_each_replica_has_its_own_default_process_group():
    cell = '''
    import torch, torch.distributed as dist, torch_xla.distributed.xla_backend
    dist.init_process_group("xla", init_method="xla://")
    t = torch.tensor([float(index + 1)], device=device)
    dist.all_reduce(t)
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    (rank, world, t.cpu().item())
    '''
    results = _ok(run(cell, 4))
    assert results == {o: (o, 4, 10.0) for o in range(4)}


@pytest.mark.parametrize("simulate", ["processes", "threads"])
def test_each_run_meets_at_a_port_of_its_own(simulate):
    # torch.distributed's xla:// and env:// meet at MASTER_ADDR:MASTER_PORT; unset, at
    # torch_xla's default port (12355), where two runs on one machine (another user's among
    # them) would meet each other. A port the replicas' environment names is kept.
    cell = "import os\n(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])"
    places = [set(_ok(run(cell, 2, simulate=simulate)).values()) for _ in range(2)]
    assert all(len(place) == 1 for place in places)  # (every replica of a run: one place)
    (first_address, first_port), (second_address, second_port) = (p.pop() for p in places)
    assert first_address == second_address == "127.0.0.1"
    assert first_port != second_port and "12355" not in (first_port, second_port)
    named = _ok(run(cell, 2, simulate=simulate, env={"MASTER_PORT": "23456"}))
    assert {port for _, port in named.values()} == {"23456"}


@pytest.mark.parametrize("simulate", ["processes", "threads"])
def test_names_the_notebook_bound_before_the_run_are_the_simulations(simulate):
    # A notebook's earlier cell bound torch_xla's own functions: the simulation replaces
    # them in each replica (processes: each a world of one; threads: XLA's rendezvous).
    notebook = {}
    exec("import torch, torch_xla.core.xla_model as xm\n"
         "from torch_xla.core.xla_model import all_reduce\n"
         "from torch_xla.runtime import process_index, world_size\n", notebook)
    cell = """
    t = all_reduce(xm.REDUCE_SUM, torch.ones(2, device=device) * (index + 1))
    (t.cpu().tolist(), world_size(), process_index())
    """
    results = _ok(run(cell, 2, simulate=simulate, user_ns=notebook))
    processes = simulate == "processes"
    assert results == {o: ([3.0, 3.0], 2, o if processes else 0) for o in range(2)}


def test_dataloader_workers_fork_from_a_replica_process():
    # Workers forked from a replica thread deadlocked (a fork of a multi-threaded process
    # whose other replicas held locks); from a process of its own they work.
    cell = '''
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    data = TensorDataset(torch.arange(32.0))
    total = sum(float(b[0].sum()) for b in DataLoader(data, batch_size=4, num_workers=2))
    total
    '''
    assert _ok(run(cell, 2, timeout=120)) == {0: 496.0, 1: 496.0}


def test_a_replica_whose_process_dies_fails_and_the_others_are_stopped_soon():
    cell = '''
    import os, signal, time, torch, torch_xla.core.xla_model as xm
    if index == 1:
        print("about to crash", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=device)).cpu()  # waits for replica 1
    '''
    outcome = run(cell, 3, timeout=120)
    assert not outcome.ok and not outcome.interrupted
    died = outcome.replicas[1]
    assert died.state == "failed" and died.error.ename == "ReplicaDied"
    assert "killed by SIGSEGV" in died.error.evalue
    assert "about to crash" in died.log.tail_text()
    for o in (0, 2):
        rep = outcome.replicas[o]
        assert rep.state == "stopped", (o, rep.state, rep.error)
        # stopped by the fail-fast rule (a --timeout would say "still running after")
        assert "after replica 1 failed (ReplicaDied)" in rep.error.evalue


def test_a_replica_process_that_exits_on_its_own_is_reported_with_its_code():
    cell = '''
    import os
    if index == 0:
        os._exit(7)
    index
    '''
    outcome = run(cell, 2, timeout=120)
    assert outcome.replicas[1].state == "done" and outcome.results() == {1: 1}
    error = outcome.replicas[0].error
    assert error.ename == "ReplicaDied" and "os._exit(7)" in error.evalue
    assert "thread of that process" not in error.evalue  # it ended alone


def test_apis_torch_xla_2_removed_name_their_replacement_in_the_replica():
    cell = '''
    import torch_xla.core.xla_model as xm
    d = xm.xla_device()
    xm.xrt_world_size()
    '''
    outcome = run(cell, 2)
    for rep in outcome.replicas.values():
        assert rep.error.ename == "AttributeError"
        assert rep.error.evalue == ("torch_xla.core.xla_model.xrt_world_size was removed in "
                                    "torch_xla 2.x: use torch_xla.runtime.world_size() instead")
        # the deprecation warning is shown once, where the cell called it
        log = rep.log.tail_text()
        # line 3 as a traceback numbers it (line 1: %%xla_spawn)
        assert "Cell In[5], line 3: DeprecationWarning: Use torch_xla.device instead" in log
    outcome = run("import torch_xla.core.xla_model as xm\nxm.get_ordinal()", 1)
    assert "use torch_xla.runtime.global_ordinal() instead" in outcome.replicas[0].error.evalue
    outcome = run("import torch_xla.core.xla_model as xm\nxm.no_such_thing", 1)
    assert outcome.replicas[0].error.evalue == (
        "module 'torch_xla.core.xla_model' has no attribute 'no_such_thing'")


def test_the_simulation_is_refused_by_name_when_unknown(monkeypatch):
    from colab_xla.errors import OptionError

    with pytest.raises(OptionError, match="--simulate fibers: give processes"):
        run("index", 2, simulate="fibers")
    monkeypatch.setenv("COLAB_XLA_SIMULATE", "fibers")
    with pytest.raises(OptionError, match="--simulate fibers: .* in COLAB_XLA_SIMULATE"):
        run("index", 2)
    monkeypatch.setenv("COLAB_XLA_SIMULATE", "threads")
    results = _ok(run("import os\nos.getpid()", 2))
    assert len(set(results.values())) == 1


def test_every_collective_between_replica_processes_gives_what_a_tpu_gives():
    cell = '''
    import torch, torch_xla, torch_xla.core.xla_model as xm, torch.distributed as dist
    import torch_xla.distributed.xla_backend
    n = 4
    out = {}
    x = torch.tensor([float(index + 1)], device=device)
    out["max"] = xm.all_reduce(xm.REDUCE_MAX, x).cpu().tolist()
    out["mul_scaled"] = xm.all_reduce(xm.REDUCE_MUL, x, scale=0.5).cpu().tolist()
    flags = [torch.tensor([index == 2], device=device)]
    xm.all_reduce(xm.REDUCE_OR, flags)                       # a list: in place
    out["or"] = flags[0].cpu().tolist()
    out["pairs"] = xm.all_reduce(xm.REDUCE_SUM, x, groups=[[0, 1], [2, 3]]).cpu().tolist()
    out["pairs_scaled"] = xm.all_reduce(xm.REDUCE_SUM, x, scale=0.5,
                                        groups=[[0, 1], [2, 3]]).cpu().tolist()
    grads = [torch.full((3,), float(index), device=device),
             torch.tensor([index], device=device)]
    xm.all_reduce(xm.REDUCE_SUM, grads, scale=0.25)          # as optimizer_step: in place
    out["grads"] = [g.cpu().tolist() for g in grads]
    out["gather"] = xm.all_gather(x.view(1, 1), dim=1).cpu().tolist()
    rs = xm.reduce_scatter(xm.REDUCE_SUM, torch.arange(8.0, device=device), 1.0 / n, 0, n)
    out["reduce_scatter"] = rs.cpu().tolist()
    a2a = xm.all_to_all(torch.arange(4.0, device=device) + 10 * index, 0, 0, n)
    out["all_to_all"] = a2a.cpu().tolist()
    ring = xm.collective_permute(x, [[i, (i + 1) % n] for i in range(n)])
    out["permute"] = ring.cpu().tolist()
    dist.init_process_group("xla", init_method="xla://")
    y = torch.tensor([float(index)], device=device)
    out["send_recv"] = None
    try:
        if index == 0:
            dist.send(torch.tensor([42.0], device=device), dst=3)   # only 0 and 3 take part
        elif index == 3:
            dist.recv(y, src=0)
        out["send_recv"] = y.cpu().tolist()
    except NotImplementedError:  # torch_xla 2.8's xla backend has none (on a TPU neither)
        pass
    out["broadcast"] = (dist.broadcast(y, src=3), y.cpu().tolist())[1]
    dist.destroy_process_group()
    out
    '''
    outcome = run(cell, 4, timeout=180)
    results = _ok(outcome)
    # Nothing of the run's processes is left in shared memory once the run is over (the
    # group's directory was left, empty, until a later run's prune).
    theirs = tuple(f"colab_xla-{os.getuid()}-{r.pid}-" for r in outcome.replicas.values())
    assert [n for n in os.listdir("/dev/shm") if n.startswith(theirs)] == []
    for o, out in results.items():
        assert out["max"] == [4.0] and out["mul_scaled"] == [12.0]
        assert out["or"] == [True]
        assert out["pairs"] == ([3.0] if o < 2 else [7.0])
        assert out["pairs_scaled"] == ([1.5] if o < 2 else [3.5])  # (through gloo)
        assert out["grads"] == [[1.5] * 3, [6]]  # (0 + 1 + 2 + 3) / 4; integers unscaled
        assert out["gather"] == [[1.0, 2.0, 3.0, 4.0]]
        assert out["reduce_scatter"] == [2.0 * o, 2.0 * o + 1]  # 4 x arange(8) / 4, its shard
        assert out["all_to_all"] == [o + 0.0, o + 10.0, o + 20.0, o + 30.0]
        assert out["permute"] == [float((o - 1) % 4 + 1)]
        if results[3]["send_recv"] is None:  # torch_xla's own refusal, not the simulation's
            assert version("torch_xla").startswith("2.8"), results
            assert out["broadcast"] == [3.0]  # replica 3's own value, broadcast
        else:
            assert out["send_recv"] == ([42.0] if o == 3 else [float(o)])
            assert out["broadcast"] == [42.0]


def test_collectives_take_every_dtype_layout_and_size_xla_gives_them():
    """Between replica processes, tensors cross from XLA to the collective as views of their
    buffers and back as buffers made on the result (DLPack): a transposed layout, a slice, a
    scalar, nothing at all, bf16, ints, bools (copied), and a list whose results are parts
    of one tensor (not all aligned as XLA needs) must all come back right, and the inputs
    must be left as they were (a view of an XLA buffer is never written)."""
    cell = '''
    import torch, torch_xla, torch_xla.core.xla_model as xm
    base = torch.arange(12.0).view(3, 4) * (index + 1)
    x = base.to(device)
    cases = {"transposed": x.t(), "slice": x[1:, 1:3], "scalar": x[0, 0],
             "empty": x[:0], "bf16": x.to(torch.bfloat16), "int": x.to(torch.int32),
             "bool": x > 12}
    out = {}
    for name, t in cases.items():
        op = xm.REDUCE_OR if t.dtype == torch.bool else xm.REDUCE_SUM
        out[name] = xm.all_reduce(op, t).cpu().tolist()
    odd = [torch.full((k,), float(index), device=device) for k in (1, 3, 5, 64, 7)]
    xm.all_reduce(xm.REDUCE_SUM, odd, scale=2.0)               # a list: in place
    out["list"] = [t.cpu().tolist() for t in odd]
    out["gather_t"] = xm.all_gather(x.t().contiguous()[:1], dim=0).cpu().tolist()
    out["unchanged"] = torch.equal(x.cpu(), base)
    out
    '''
    results = _ok(run(cell, 3, timeout=180))
    import torch

    total = torch.arange(12.0).view(3, 4) * 6  # (1 + 2 + 3) times the base
    for o, out in results.items():
        assert out["transposed"] == total.t().tolist()
        assert out["slice"] == total[1:, 1:3].tolist()
        assert out["scalar"] == 0.0 and out["empty"] == []
        assert out["bf16"] == total.to(torch.bfloat16).tolist()
        assert out["int"] == total.to(torch.int32).tolist()
        # x > 12 on any replica: index 1's 2*base > 12 from 7 on, index 2's 3*base from 5 on
        assert out["bool"] == (torch.arange(12.0).view(3, 4) * 3 > 12).tolist()
        assert out["list"] == [[2.0 * (0 + 1 + 2)] * k for k in (1, 3, 5, 64, 7)]
        assert out["gather_t"] == [[float(r * 4 * m) for r in range(3)]
                                   for m in (1, 2, 3)]
        assert out["unchanged"] is True


def test_a_large_all_reduce_comes_back_through_a_result_file_right_and_each_replicas_own():
    """A result of a chunk (1 MiB) or more is a copy-on-write mapping of one file every
    replica reduced into (tests/test_shm_collectives.py: written in place, it stays the
    others' as it was): the result and its list form (parts of one tensor, not all aligned
    as XLA needs) come back right, and a replica's in-place change is its own."""
    cell = '''
    import torch, torch_xla, torch_xla.core.xla_model as xm
    from colab_xla.runtimes import shm_collectives
    n = shm_collectives.CHUNK_BYTES // 4 + 5  # float32: a chunk and a part of the next
    x = torch.full((n,), float(index + 1), device=device)
    y = xm.all_reduce(xm.REDUCE_SUM, x)
    y.add_(index * 100.0)  # in place
    torch_xla.sync()
    xm.rendezvous("added")  # every replica has changed its own result by now
    mine = y.cpu()
    parts = [torch.full((k,), float(index), device=device) for k in (n // 2, 3, n - n // 2)]
    xm.all_reduce(xm.REDUCE_SUM, parts)
    ops = next(c.cell_contents for c in xm.all_reduce.__closure__
               if hasattr(c.cell_contents, "__self__")).__self__  # (colab_xla's collectives)
    (mine.min().item(), mine.max().item(), [p.cpu().unique().tolist() for p in parts],
     ops._group._shared.pool.taken)
    '''
    results = _ok(run(cell, 3, timeout=240))
    for o, (low, high, parts, files) in results.items():
        assert low == high == 6.0 + o * 100.0, (o, low, high)  # 1 + 2 + 3, and its own add
        assert parts == [[3.0], [3.0], [3.0]]  # 0 + 1 + 2
        assert files == 2  # (both through a result file)


def test_each_replica_process_gets_its_share_of_the_cores_unless_omp_num_threads_says(
        monkeypatch):
    """As torchrun does: N replica processes of one machine do not each run a pool of as many
    threads as cores (their copies and reductions spun against each other)."""
    cores = len(os.sched_getaffinity(0))
    cell = "import torch\ntorch.get_num_threads()"
    for n in (2, 4):
        threads = _ok(run(cell, n))
        assert set(threads.values()) == {max(1, cores // n)}, threads
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    # the user's choice stands (torch read it when it was imported; set here, it is the
    # value torch reports in a process that imports it anew: the replicas inherit torch)
    import torch

    before = torch.get_num_threads()
    threads = _ok(run(cell, 2))
    assert set(threads.values()) == {before}, threads


WHERE_REPLICAS_MEET = LISTENING + '''
import torch, torch_xla.core.xla_model as xm
t = torch.ones(1, device=device)
total = xm.all_reduce(xm.REDUCE_SUM, t).item()
xm.all_reduce(xm.REDUCE_SUM, [t], groups=[[0], [1]])  # (groups of some replicas: gloo)
(total, _listening())
'''


def test_replica_processes_of_one_machine_listen_on_loopback_alone():
    # Another user of the machine sees every listening socket (/proc/net/tcp): a TCP store
    # (no authentication) or gloo on the machine's address would be theirs to reach.
    for o, (total, listening) in _ok(run(WHERE_REPLICAS_MEET, 2)).items():
        assert total == 2.0 and listening and not_loopback(listening) == [], (o, listening)


def test_where_the_hostname_resolves_elsewhere_replica_processes_listen_on_loopback_alone():
    # (on a TPU VM or in a container the hostname is the machine's address, where gloo's
    # default device listens)
    code = ("import json\nfrom colab_xla.notebook.targets import run_cell\n"
            f"outcome = run_cell({WHERE_REPLICAS_MEET!r}, replicas=2, announce=None)\n"
            "print('RESULT', json.dumps(outcome.results() if outcome.ok else repr(\n"
            "    [r.error for r in outcome.replicas.values()])))\n")
    done = run_with_hostname_elsewhere(code)
    results = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == 1 and isinstance(results[0], dict), (done.stdout[-3000:],
                                                                 done.stderr[-3000:])
    for o, (total, listening) in results[0].items():
        assert total == 2.0 and listening and not_loopback(listening) == [], (o, listening)


@pytest.mark.parametrize("simulate", ["processes", "threads"])
def test_a_simulated_host_says_it_is_a_cpu(simulate):
    # The decision of docs/simulation.md ("What a simulated host says it is"): code that
    # branches on a TPU must not take the TPU's paths on the CPU.
    cell = '''
    import torch_xla.core.xla_model as xm, torch_xla.runtime as xr
    (xm.xla_device_hw(device), xr.device_type())
    '''
    assert _ok(run(cell, 2, simulate=simulate)) == {0: ("CPU", "CPU"), 1: ("CPU", "CPU")}
