"""``--runtime torch``: PyTorch's own distributed processes (colab_xla.runtimes.torch).

Units of its plan and of torchrun's variables, then real processes on gloo (this machine
has no GPU and no TPU): ranks and variables, a cell written as a torchrun script, DDP
training that leaves every rank the same weights, fail-fast while the others wait in a
collective, a session that keeps a model across cells and survives an Interrupt, and where
the processes meet: nothing another user could reach (a file on one host, loopback alone).
"""

from __future__ import annotations

import importlib.util
import json
import re
import time

import pytest

from _listeners import LISTENING, not_loopback, other_address, run_with_hostname_elsewhere
from _runs import run

from colab_xla import runtimes
from colab_xla.errors import OptionError
from colab_xla.notebook.launch import Launch
from colab_xla.notebook.views import text as text_view
from colab_xla.notebook.outcome import DONE, FAILED, STOPPED
from colab_xla.notebook.targets import run_cell
from colab_xla.runtimes import torch as torch_runtime
from colab_xla.runtimes.plan import Hardware, ReplicaCountError
from colab_xla.wire.host_rank import HostRank

pytestmark = pytest.mark.stacks("torchtpu")  # (the gloo stand-in, beside torch_tpu)

CPU = Hardware(pjrt_device=None)
TORCH = runtimes.get("torch")

# -- units -------------------------------------------------------------------------------


@pytest.mark.quick
def test_on_cpu_it_plans_gloo_processes_eight_by_default():
    plan = TORCH.plan(None, CPU, environ={})
    assert (plan.device_type, plan.replicas, plan.processes) == ("CPU", 8, 8)
    assert plan.own_processes and plan.runtime is TORCH
    assert plan.env == {runtimes.VARIABLE: "torch", torch_runtime.DEVICE: "CPU"}
    assert "8 processes on CPU (torch.distributed with gloo)" in plan.note
    assert TORCH.plan(1, CPU, environ={}).note.startswith("colab_xla: torch runtime, 1 process ")


@pytest.mark.quick
def test_one_process_per_cuda_gpu_unless_cpu_is_forced():
    plan = torch_runtime.plan(None, CPU, {}, cuda_devices=2)
    assert (plan.device_type, plan.replicas, plan.env[torch_runtime.DEVICE]) == ("CUDA", 2, "CUDA")
    assert "one per CUDA GPU (NCCL)" in plan.note
    with pytest.raises(ReplicaCountError, match="-n 3: this machine has 2 CUDA GPUs"):
        torch_runtime.plan(3, CPU, {}, cuda_devices=2)
    forced = torch_runtime.plan(3, CPU, {"PJRT_DEVICE": "CPU"}, cuda_devices=2)
    assert (forced.device_type, forced.replicas) == ("CPU", 3)


@pytest.mark.quick
def test_bad_counts_a_tpu_host_and_torch_xlas_options_are_refused():
    with pytest.raises(ReplicaCountError, match="-n 0: the number of processes must be 1"):
        TORCH.plan(0, CPU, environ={})
    with pytest.raises(ReplicaCountError, match="at most 16 processes on CPU"):
        TORCH.plan(17, CPU, environ={})
    if importlib.util.find_spec("torch_tpu") is None:
        with pytest.raises(ReplicaCountError, match="needs TorchTPU .* pip install torch-tpu"):
            TORCH.plan(None, Hardware(pjrt_device=None, tpu_chips=4), environ={})
    assert TORCH.plan(2, Hardware(pjrt_device=None, tpu_chips=4),
                      environ={"PJRT_DEVICE": "CPU"}).device_type == "CPU"
    for asked in ({"launcher": "launch"}, {"debug_single": True}, {"devices_per_process": 2}):
        with pytest.raises(OptionError):
            Launch(runtime=TORCH, **asked)
    Launch(runtime=TORCH)


@pytest.mark.quick
def test_torchruns_variables_from_the_launchers_rank_and_a_clusters_host():
    one = torch_runtime.torchrun_environ({"PJRT_LOCAL_PROCESS_RANK": "2",
                                          "PJRT_LOCAL_PROCESS_COUNT": "4",
                                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242"})
    assert {k: one[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242"}
    host = HostRank(host=1, hosts=2, replicas=2, address="10.0.0.3")
    on_host = torch_runtime.torchrun_environ({"PJRT_LOCAL_PROCESS_RANK": "1",
                                              "PJRT_LOCAL_PROCESS_COUNT": "2",
                                              torch_runtime.MASTER: "10.0.0.2:5555",
                                              **host.environ()})
    assert (on_host["RANK"], on_host["LOCAL_RANK"], on_host["WORLD_SIZE"],
            on_host["NODE_RANK"], on_host["MASTER_ADDR"], on_host["MASTER_PORT"]) == (
        "3", "1", "4", "1", "10.0.0.2", "5555")
    cpu_hosts = [{"device": "CPU", "address": a} for a in ("10.0.0.2", "10.0.0.3")]
    environ = TORCH.cluster_environ(cpu_hosts, lambda: "10.0.0.2:5555")
    secret = environ.pop(torch_runtime.STORE_SECRET)
    assert environ == {torch_runtime.MASTER: "10.0.0.2:5555"}
    # (the store's keys under a secret of each run's: anyone can reach host 0's address)
    assert re.fullmatch("[0-9a-f]{32}", secret) and secret != TORCH.cluster_environ(
        cpu_hosts, lambda: "10.0.0.2:5555")[torch_runtime.STORE_SECRET]
    # TPU hosts: TorchTPU's worker list, host 0 first (its NODE_RANK is the host's).
    tpu_hosts = [{"device": "TPU", "address": a} for a in ("10.0.0.2", "10.0.0.3")]
    environ = TORCH.cluster_environ(tpu_hosts, lambda: "10.0.0.2:5555")
    environ.pop(torch_runtime.STORE_SECRET)
    assert environ == {torch_runtime.MASTER: "10.0.0.2:5555",
                       "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}


@pytest.mark.quick
def test_the_store_rank_0_serves_listens_on_its_address_alone():
    import torch.distributed as dist

    scope: dict = {}
    exec(LISTENING, scope)  # noqa: S102 - the cells' own probe, on this process
    store = torch_runtime.listening_store("127.0.0.1", 0, wait_for_workers=False)
    try:
        # (torch's own master listens on "::", every interface, whatever host it is given)
        assert [a for a in scope["_listening"]() if a[1] == store.port] == [
            ("127.0.0.1", store.port)]
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        client.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store
    with pytest.raises(OSError):  # (an address not this machine's: refused, nothing left)
        torch_runtime.listening_store("192.0.2.123", 0, wait_for_workers=False)


@pytest.mark.quick
def test_values_come_back_on_the_cpu():
    import torch

    class Meta:  # a tensor that is not on the CPU, without a device here
        pass
    meta = torch.empty(2, device="meta")
    assert torch_runtime.to_host({"a": [torch.ones(1)], "b": 3})["b"] == 3
    with pytest.raises(NotImplementedError):  # (meta tensors have no data: .cpu() says so)
        torch_runtime.to_host(meta)
    assert torch_runtime.to_host(Meta) is Meta


@pytest.mark.quick
def test_cuda_initialized_in_the_notebook_is_refused_before_forking(monkeypatch):
    import torch

    assert torch_runtime.cuda_problem() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    problem = torch_runtime.cuda_problem()
    assert problem.code == torch_runtime.DEVICE_OPENED and "restart the kernel" in problem.fix
    assert runtimes.started_by(problem) is TORCH
    assert torch_runtime.STARTING_CALLS.search("x = torch.ones(3).cuda()")
    assert not torch_runtime.STARTING_CALLS.search("x = torch.ones(3)")


# -- real processes (gloo) ---------------------------------------------------------------


def cell(source: str, **kw):
    kw.setdefault("replicas", 2)
    return run(source, launch=Launch(runtime=TORCH), label="Cell In[3]", **kw)


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_no_rank_starts_its_cell_before_every_rank_has_made_the_group(monkeypatch, tmp_path):
    # Rank 0 is made slow just after its side of gloo's connections (the processes fork
    # from here). A rank that went on before it could end and close its connections while
    # rank 0 still read them ("Connection closed by peer", a failure seen in this suite).
    import torch.distributed.distributed_c10d as c10d

    made = tmp_path / "rank0"

    class SlowRankZero(c10d.ProcessGroupGloo):
        def __init__(self, store, rank, *args, **kwargs):
            super().__init__(store, rank, *args, **kwargs)
            if rank == 0:
                time.sleep(1.0)
                made.write_text(repr(time.time()))

    monkeypatch.setattr(c10d, "ProcessGroupGloo", SlowRankZero)
    outcome = cell("import time\ntime.time()", replicas=3)
    assert outcome.ok, text_view.render(outcome)
    assert all(started >= float(made.read_text())
               for started in outcome.results().values()), outcome.results()


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_each_process_has_torchruns_variables_and_the_group_made():
    outcome = cell("""
        import os, torch.distributed as dist
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT")
        ({n: os.environ[n] for n in names}, dist.is_initialized(), dist.get_backend(),
         dist.get_rank(), str(device))
        """, replicas=3)
    assert outcome.ok, text_view.render(outcome)
    values = outcome.results()
    ports = {v[0]["MASTER_PORT"] for v in values.values()}
    assert len(ports) == 1
    for i, (env, made, backend, rank, dev) in values.items():
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"],
                env["GROUP_RANK"]) == (str(i), str(i), "3", "3", "0")
        assert (made, backend, rank, dev) == (True, "gloo", i, "cpu")
    # Gloo's banner as it makes the group (C's stdout) is not the cell's output; a
    # process's own prints from C still are.
    assert all("[Gloo]" not in r.log.tail_text() for r in outcome.replicas.values())
    from_c = cell("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.printf(b'from C %d\\n', index)\n"
                  "libc.fflush(None)")
    assert [r.log.tail_text() for r in from_c.replicas.values()] == ["from C 0", "from C 1"]


WHERE_THEY_MEET = LISTENING + """
import os, torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)  # (gloo's connections made)
store = dist.distributed_c10d._get_default_store()
while isinstance(store, dist.PrefixStore):
    store = store.underlying_store
(type(store).__name__, _listening(),
 int(os.environ["MASTER_PORT"]), os.environ.get("GLOO_SOCKET_IFNAME"), t.item())
"""


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_on_one_host_the_processes_meet_through_a_file_and_listen_on_loopback_alone():
    # A TCP store has no authentication, and torch's listened on every interface: any
    # user of the machine could set a key this run's ranks then read.
    outcome = cell(WHERE_THEY_MEET, replicas=3)
    assert outcome.ok, text_view.render(outcome)
    for rank, (store, listening, master_port, ifname, total) in outcome.results().items():
        assert (store, ifname, total) == ("FileStore", "lo", 3.0), rank
        assert listening and not_loopback(listening) == [], (rank, listening)  # (gloo's)
        assert master_port not in {port for _, port in listening}, rank


IN_A_NAMESPACE = """
import json
from colab_xla.notebook.launch import Launch
from colab_xla.notebook.targets import run_cell
for env in ({}, {"GLOO_SOCKET_IFNAME": IFNAME}):
    outcome = run_cell(CELL, replicas=2, launch=Launch(runtime="torch"), announce=None,
                       env=env)
    print("RESULT", json.dumps(outcome.results() if outcome.ok else repr(
        [r.error for r in outcome.replicas.values()])))
"""


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_where_the_hostname_resolves_elsewhere_gloo_listens_on_loopback_unless_asked():
    # On a TPU VM or in a container the hostname is the machine's address, where gloo's
    # default device listens; one host's processes need none but loopback.
    ifname, address = other_address() or (None, None)
    done = run_with_hostname_elsewhere(f"CELL = {WHERE_THEY_MEET!r}\nIFNAME = {ifname!r}\n"
                                       + IN_A_NAMESPACE)
    results = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == 2, (done.stdout[-3000:], done.stderr[-3000:])
    mine, asked = results
    assert isinstance(mine, dict) and isinstance(asked, dict), results
    for store, listening, _, ifname_seen, _ in mine.values():
        assert (store, ifname_seen) == ("FileStore", "lo")
        assert listening and not_loopback(listening) == [], listening
    # A GLOO_SOCKET_IFNAME of the user's is theirs: gloo listens where it says.
    for _, listening, _, ifname_seen, total in asked.values():
        assert (ifname_seen, total) == (ifname, 2.0)
        assert [a for a, _ in not_loopback(listening)] == [address], listening


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_cell_written_as_a_torchrun_script_runs_unchanged():
    outcome = cell("""
        import torch, torch.distributed as dist
        dist.init_process_group(backend="gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        t.item()
        """)
    assert outcome.ok, text_view.render(outcome)
    assert outcome.results() == {0: 3.0, 1: 3.0}
    refused = cell("import torch.distributed as dist\ndist.init_process_group('nccl')")
    error = refused.replicas[0].error
    assert error.ename == "ValueError" and "made this process's default group with 'gloo'" \
        in error.evalue, error


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_ddp_training_leaves_every_rank_the_same_weights():
    outcome = cell("""
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(index)  # different starting weights: DDP broadcasts rank 0's
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + index)  # each rank its own data
        for step in range(20):
            x = torch.randn(32, 8, generator=g)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        torch.cat([p.detach().flatten() for p in model.parameters()])
        """, replicas=4)
    assert outcome.ok, text_view.render(outcome)
    weights = outcome.results()
    assert all(w.equal(weights[0]) for w in weights.values())


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_rank_that_raises_stops_the_others_waiting_in_all_reduce_within_seconds():
    started = time.monotonic()
    outcome = cell("""
        import torch, torch.distributed as dist
        if index == 1:
            raise ValueError("rank 1 has no data")
        t = torch.ones(1)
        dist.all_reduce(t)   # waits for rank 1 for ever
        """)
    took = time.monotonic() - started
    assert outcome.replicas[1].state == FAILED and "rank 1 has no data" in \
        outcome.replicas[1].error.evalue
    # Rank 1's process ends with its cell: gloo tells rank 0 at once (the connection
    # closed); where it does not, the fail-fast rule stops rank 0 seconds later.
    other = outcome.replicas[0]
    assert (other.state == STOPPED and "after replica 1 failed (ValueError)" in
            other.error.evalue) or (other.state == FAILED and "gloo" in other.error.evalue
                                    and re.search(r"Connection (closed|reset) by peer",
                                                  other.error.evalue)), other.error
    assert took < 60, took  # (the collective's own timeout is minutes)


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_session_keeps_its_model_and_group_across_cells_and_an_interrupt():
    from colab_xla.notebook.targets.session import SessionOptions, new_session

    session = new_session(SessionOptions(replicas=2, launch=Launch(runtime=TORCH)), {},
                          announce=None)
    try:
        first = run_cell("import torch, torch.distributed as dist\n"
                         "dist.init_process_group('gloo')\n"
                         "torch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n"
                         "dist.destroy_process_group()", session=session, announce=None)
        assert first.ok, [r.error for r in first.replicas.values()]
        # An Interrupt (here: --timeout) of a sleep: the replicas' main threads stop it.
        slept = run_cell("import time\ntime.sleep(60)", session=session, announce=None,
                         timeout=1)
        assert [r.state for r in slept.replicas.values()] == [STOPPED, STOPPED]
        assert slept.session_ended is None and session.up
        # (a group made in a later cell meets through the store of the first: the
        # session's, kept as long as its processes)
        kept = run_cell("w = model.weight.detach().clone()\n"
                        "dist.all_reduce(w, group=dist.new_group([0, 1]))\n"
                        "(dist.get_world_size(), w.sum().item() / 2, "
                        "model.weight.sum().item())", session=session, announce=None)
        assert kept.ok, [r.error for r in kept.replicas.values()]
        (world, mean, mine), other = kept.results()[0], kept.results()[1]
        assert world == 2 and abs(mean - mine) < 1e-6 and other == (world, mean, mine)
        assert all(r.state == DONE for r in kept.replicas.values())
    finally:
        session.stop()


# A torchrun script split across a notebook's cells as a user splits it: shaped like
# pytorch/examples' distributed/ddp-tutorial-series/multigpu_torchrun.py (on CPU, gloo), its
# imports and helpers at module level in plain cells, its main() in the %%xla_spawn cell.
SPLIT_SCRIPT = ("""
import os
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group
""", """
def ddp_setup():
    init_process_group(backend="gloo")
""", """
class Trainer:
    def __init__(self, model, data, optimizer):
        self.rank = int(os.environ["RANK"])
        self.model, self.data, self.optimizer = DDP(model), data, optimizer

    def train(self, epochs):
        for epoch in range(epochs):
            self.data.sampler.set_epoch(epoch)
            for source, targets in self.data:
                self.optimizer.zero_grad()
                torch.nn.functional.mse_loss(self.model(source), targets).backward()
                self.optimizer.step()
""", """
def main(total_epochs, batch_size):
    ddp_setup()
    torch.manual_seed(int(os.environ["RANK"]))  # each rank its own start: DDP gives rank 0's
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.rand(64, 20, generator=g), torch.rand(64, 1, generator=g))
    model = torch.nn.Linear(20, 1)
    trainer = Trainer(model, DataLoader(dataset, batch_size=batch_size,
                                        sampler=DistributedSampler(dataset)),
                      torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.train(total_epochs)
    destroy_process_group()
    return torch.cat([p.detach().flatten() for p in model.parameters()])
""")
SCRIPT_NAMES = ("init_process_group", "destroy_process_group", "ddp_setup", "Trainer", "main")
SPLIT_SCRIPT_RUN = """
weights = main(total_epochs=2, batch_size=8)
destroy_process_group()  # (the cell's own, again: the group stays for the next cell)
weights, dist.is_initialized()"""


@pytest.fixture
def shell():
    from test_magic import get_ipython  # (tests/ is on sys.path)

    ip = get_ipython()
    ip.run_line_magic("load_ext", "colab_xla")
    for name in SCRIPT_NAMES:  # (the shell is one for the tests: a notebook without them)
        ip.user_ns.pop(name, None)
    yield ip
    from colab_xla.notebook import targets

    targets.stop_session()


def define_split_script(ip) -> None:
    for source in SPLIT_SCRIPT:
        assert ip.run_cell(source).success


def run_split_script(ip, capsys, line: str):
    """The script's main() in a %%xla_spawn cell of ``ip``: each rank's weights and whether
    the group is still there."""
    ip.user_ns.pop("got", None)
    ran = ip.run_cell(f"%%xla_spawn --no-widget -o got {line}{SPLIT_SCRIPT_RUN}")
    assert ran.success, capsys.readouterr().out[-3000:]
    return ip.user_ns["got"]


def same_weights_group_kept(got) -> bool:
    return (sorted(got) == [0, 1] and all(w.equal(got[0][0]) for w, _ in got.values())
            and all(kept for _, kept in got.values()))


@pytest.mark.xla
@pytest.mark.timeout(300)
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_script_split_across_cells_runs_its_own_imported_init_and_destroy(shell, capsys,
                                                                           start):
    # Forked, the replicas inherit the notebook's names bound to torch's own functions;
    # spawned, they load them before the group is made.
    define_split_script(shell)
    got = run_split_script(shell, capsys, f"--runtime torch -n 2 --start-method {start}")
    assert same_weights_group_kept(got), got


@pytest.mark.xla
@pytest.mark.timeout(300)
@pytest.mark.parametrize("defined", ["before the session", "in the session"])
def test_a_session_runs_a_script_split_across_cells(shell, capsys, defined):
    # The session's processes inherit the names defined before it started; a cell sends
    # the names it uses that they do not have as the notebook has them.
    if defined == "before the session":
        define_split_script(shell)
    shell.run_line_magic("xla_session", "start -n 2 --runtime torch")
    if defined == "in the session":
        define_split_script(shell)
    first = run_split_script(shell, capsys, "")
    define_split_script(shell)  # (the cells run again: their names sent to warm processes)
    again = run_split_script(shell, capsys, "")  # (the group kept: destroy waits)
    assert same_weights_group_kept(first) and same_weights_group_kept(again), (first, again)


def test_the_runtime_is_a_choice_of_every_magic():
    assert "torch" in runtimes.RUNTIMES
    assert runtimes.get("torch") is TORCH and TORCH.preloads == ("torch.distributed",)



NO_TORCH_XLA = """
import importlib.util, sys
sys.modules["torch_xla"] = None  # as if it were not installed
_find = importlib.util.find_spec
importlib.util.find_spec = (lambda name, *a, **k: None if name.split(".")[0] == "torch_xla"
                            else _find(name, *a, **k))
from colab_xla.notebook.launch import Launch
from colab_xla.notebook.targets import run_cell
outcome = run_cell("import torch.distributed as dist\\ndist.get_world_size()", replicas=2,
                   launch=Launch(runtime="torch"), announce=None)
print(outcome.ok, outcome.results() if outcome.ok else outcome)
"""


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_machine_with_pytorch_alone_runs_it():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NO_TORCH_XLA], capture_output=True,
                          text=True, timeout=240)
    assert done.stdout.strip().splitlines()[-1:] == ["True {0: 2, 1: 2}"], (done.stdout,
                                                                            done.stderr[-3000:])


@pytest.mark.quick
def test_the_doctor_says_what_the_torch_runtime_would_start_here(monkeypatch):
    import torch

    from colab_xla.notebook import doctor

    facts = dict(doctor.diagnose(environ={}, history=[]).facts)
    assert facts["--runtime torch"].startswith(f"torch {torch.__version__.split('+')[0]}")
    assert facts["--runtime torch"].endswith("8 processes on CPU (torch.distributed with gloo).")
    assert facts["  its device"] == "not opened by this notebook (good)"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    held = dict(torch_runtime.doctor_facts(CPU, {}, doctor.installed_version))["  its device"]
    assert held.startswith("CUDA is initialized in this notebook's own process")
