"""The simulation is torch_xla: every public collective of ``torch_xla.core.xla_model`` and
of the ``xla`` torch.distributed backend, run in real ``%%xla_spawn -n 4`` cells on both
simulations, gives what torch_xla's own gives (results, shapes, dtypes, in-place
semantics), and refuses bad arguments with torch_xla's own errors.

What is checked is what torch_xla's multiprocessing tests (pytorch/xla's
``test/test_mp_*.py`` and ``test/torch_distributed/``) check, written here. Each behaviour
is a source of its own defining ``inputs()`` (eager set-up: the replica's tensors),
``step(*inputs)`` (the collective, what a mode wraps) and ``expected()`` (plain torch on
the CPU, from ``index`` and ``world``). One cell per simulation runs them all (a run costs
seconds): the cell's harness wraps ``step`` for its ``mode`` (``eager``) and returns, per
behaviour, the step's result and its inputs afterwards (for in-place semantics) next to
what was expected, as plain values.

Bad arguments: each case is run on the simulations and on torch_xla alone (one replica,
one CPU device, no simulation), where torch_xla checks them before any communication;
the errors must be the same. The threads simulation runs torch_xla's own collectives, so
for the checks a world of one skips (``xm.all_reduce`` returns a copy on one device) the
processes simulation's errors are compared with the threads'. (torch_xla 2.8's C++ errors
carry a C++ stack trace and where they were raised: the message after them is compared.)

docs/simulation.md's table lists each collective's result here.
"""

import re
import textwrap
from importlib.metadata import PackageNotFoundError, version

import pytest

from _shell import ip_fixture

pytestmark = [pytest.mark.xla, pytest.mark.timeout(600), pytest.mark.stacks("colab", "kaggle")]

SIMULATIONS = ("processes", "threads")
# How a behaviour's step runs: as it is; under torch.compile(backend="openxla") (no fullgraph:
# what Dynamo cannot trace breaks the graph, and must give the eager result; fullgraph=True is
# tests/test_traced_collectives.py's); under torch_xla.compile (traced lazily, not by Dynamo).
MODES = ("eager", "torch.compile", "torch_xla.compile")
# torch.compile is refused on threads, with the reason (tests/test_traced_collectives.py).
NO_MODE = {("threads", "torch.compile"): "torch.compile is refused with --simulate threads"}
# The xla backend's ops in one compiled step with other ops: on Python 3.13 Dynamo's fake
# tensors refuse dist.all_gather into a list, and openxla's bridge loses a compiled piece
# between two of them ("Failed to get computation by hash", as it does around any op torch_xla
# runs on the CPU). Each traced op in a step of its own: tests/test_traced_collectives.py.
NOT_COMPILED = ("the xla backend's ops are compiled one to a step in "
                "tests/test_traced_collectives.py (docs/simulation.md)")
WORLD = 4

# The cell's harness: MODE, then every behaviour's source through _behaviour().
HARNESS = '''
import torch, torch_xla, torch_xla.core.xla_model as xm, torch_xla.runtime as xr
import torch.distributed as dist, torch_xla.distributed.xla_backend

def _wrap(step, mode):
    if mode == "eager":
        return step
    if mode == "torch.compile":
        return torch.compile(step, backend="openxla")
    if mode == "torch_xla.compile":
        return torch_xla.compile(step)
    raise ValueError(f"no such mode: {mode!r}")

def _plain(value):
    if isinstance(value, torch.Tensor):
        cpu = value.detach().cpu()
        return ("tensor", tuple(cpu.shape), str(cpu.dtype), cpu.tolist())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_plain(v) for v in value])
    return value

_results = {}

def _behaviour(name, source):
    space = dict(torch=torch, xm=xm, xr=xr, dist=dist, torch_xla=torch_xla, device=device,
                 index=index, world=xr.world_size())
    exec(source, space)
    try:
        args = space["inputs"]() if "inputs" in space else ()
        got = _wrap(space["step"], MODE)(*args)
        torch_xla.sync()
        got = {"result": _plain(got), "inputs": _plain(list(args))}
    except Exception as e:
        got = ("error", type(e).__name__, str(e))
    want = space["expected"]() if "expected" in space else None
    if isinstance(want, dict) and "error" in want:
        want = ("error",) + tuple(want["error"])
    elif want is not None:
        want = {key: _plain(value) for key, value in want.items()}
    _results[name] = (got, want)
'''

# Pinned and unpinned (pin_layout=False) all-reduces or reduce-scatters in one program are
# refused by XLA's HLO verifier ("a mix of layout constrained and unconstrained"), on a TPU
# as on the threads simulation; the processes simulation runs each collective by itself and
# does not refuse it. So a behaviour keeps to one of them.
# name -> source. Values are small integers (in floats too): sums, products and scales by
# powers of two are exact, so results compare equal, not close.
BEHAVIOURS = {
    "all_reduce: a tensor, sum, mul, min, max: a new tensor": '''
def x_of(i):
    return torch.arange(8.0).reshape(2, 4) + 10 * i + 1
def inputs():
    return (x_of(index).to(device),)
def step(x):
    out = [xm.all_reduce(t, x) for t in (xm.REDUCE_SUM, xm.REDUCE_MUL, xm.REDUCE_MIN,
                                         xm.REDUCE_MAX)]
    return out + [out[0] is x]
def expected():
    xs = torch.stack([x_of(i) for i in range(world)])
    return {"result": [xs.sum(0), xs.prod(0), xs.min(0).values, xs.max(0).values, False],
            "inputs": [x_of(index)]}
''',
    "all_reduce: and, or": '''
def inputs():
    return (torch.tensor([1 << index | 16], dtype=torch.int32).to(device),)
def step(bits):
    return [xm.all_reduce(xm.REDUCE_AND, bits), xm.all_reduce(xm.REDUCE_OR, bits)]
def expected():
    return {"result": [torch.tensor([16], dtype=torch.int32),
                       torch.tensor([sum(1 << i for i in range(world)) | 16], dtype=torch.int32)],
            "inputs": [torch.tensor([1 << index | 16], dtype=torch.int32)]}
''',
    "all_reduce: scale, dtypes": '''
def inputs():
    return (torch.full((3,), 2.0 * (index + 1)).to(device),
            torch.full((3,), index + 1, dtype=torch.int32).to(device))
def step(f, i):
    return [xm.all_reduce(xm.REDUCE_SUM, f, scale=1.0 / world),
            xm.all_reduce(xm.REDUCE_SUM, f), xm.all_reduce(xm.REDUCE_SUM, i)]
def expected():
    total = sum(2.0 * (o + 1) for o in range(world))
    return {"result": [torch.full((3,), total / world), torch.full((3,), total),
                       torch.full((3,), sum(range(1, world + 1)), dtype=torch.int32)],
            "inputs": [torch.full((3,), 2.0 * (index + 1)),
                       torch.full((3,), index + 1, dtype=torch.int32)]}
''',
    "all_reduce: bfloat16": '''
def inputs():
    return (torch.full((2,), float(index), dtype=torch.bfloat16).to(device),)
def step(b):
    return xm.all_reduce(xm.REDUCE_MAX, b)
def expected():
    return {"result": torch.full((2,), float(world - 1), dtype=torch.bfloat16),
            "inputs": [torch.full((2,), float(index), dtype=torch.bfloat16)]}
''',
    "all_reduce: groups": '''
def inputs():
    return (torch.tensor([float(index + 1)]).to(device),)
def step(x):
    return [xm.all_reduce(xm.REDUCE_SUM, x, groups=[[0, 1], [2, 3]]),
            xm.all_reduce(xm.REDUCE_SUM, x, groups=[[0, 2], [1, 3]]),
            xm.all_reduce(xm.REDUCE_MAX, x, scale=0.5, groups=[[0, 1, 2, 3]])]
def expected():
    pair = [0, 1] if index < 2 else [2, 3]
    parity = [o for o in range(world) if o % 2 == index % 2]
    return {"result": [torch.tensor([float(sum(o + 1 for o in pair))]),
                       torch.tensor([float(sum(o + 1 for o in parity))]),
                       torch.tensor([world * 0.5])],
            "inputs": [torch.tensor([float(index + 1)])]}
''',
    "all_reduce: a list, in place, the list itself returned": '''
def inputs():
    return (torch.full((2,), float(index)).to(device), torch.full((3,), index + 1.0).to(device))
def step(a, b):
    xs = [a, b]
    out = xm.all_reduce(xm.REDUCE_SUM, xs, scale=0.5)
    return [out is xs, out[0] is a, out[1] is b]
def expected():
    return {"result": [True, True, True],
            "inputs": [torch.full((2,), sum(range(world)) * 0.5),
                       torch.full((3,), sum(range(1, world + 1)) * 0.5)]}
''',
    "all_gather: a tensor, each dim, pinned or not": '''
def x_of(i):
    return torch.arange(6.0).reshape(2, 3) + 10 * i
def inputs():
    return (x_of(index).to(device),)
def step(x):
    return [xm.all_gather(x), xm.all_gather(x, dim=1), xm.all_gather(x, dim=-1),
            xm.all_gather(x, pin_layout=False), xm.all_gather(x, dim=1, pin_layout=False)]
def expected():
    xs = [x_of(i) for i in range(world)]
    return {"result": [torch.cat(xs), torch.cat(xs, 1), torch.cat(xs, 1), torch.cat(xs),
                       torch.cat(xs, 1)],
            "inputs": [x_of(index)]}
''',
    "all_gather: groups": '''
def inputs():
    return (torch.tensor([float(index)]).to(device),)
def step(x):
    return [xm.all_gather(x, groups=[[0, 2], [1, 3]]),
            xm.all_gather(x, groups=[[0, 1], [2, 3]], pin_layout=False)]
def expected():
    parity = [float(o) for o in range(world) if o % 2 == index % 2]
    pair = [0.0, 1.0] if index < 2 else [2.0, 3.0]
    return {"result": [torch.tensor(parity), torch.tensor(pair)],
            "inputs": [torch.tensor([float(index)])]}
''',
    "all_gather: output= of any shape takes the result, the same tensor returned": '''
def inputs():
    # of the same rank: torch_xla's own tensor keeps its shape's rank (a tensor of another
    # rank fails in .detach().cpu() after torch_xla's own _out collectives)
    return (torch.full((2, 3), float(index)).to(device), torch.zeros(2, 3).to(device),
            torch.zeros(1, 1).to(device))
def step(x, out, other):
    r = xm.all_gather(x, output=out)
    s = xm.all_gather(x, dim=1, output=other, pin_layout=False)
    return [r is out, s is other]
def expected():
    xs = [torch.full((2, 3), float(i)) for i in range(world)]
    return {"result": [True, True],
            "inputs": [torch.full((2, 3), float(index)), torch.cat(xs), torch.cat(xs, 1)]}
''',
    "all_gather: a list, into a list output=, bucketized": '''
def inputs():
    return (torch.full((2,), float(index)).to(device), torch.full((1, 2), index + 1.0).to(device),
            torch.zeros(2).to(device), torch.zeros(1, 2).to(device))
def step(a, b, out_a, out_b):
    listed = xm.all_gather([a, b], pin_layout=False)
    outs = [out_a, out_b]
    into = xm.all_gather([a, b], dim=0, output=outs, pin_layout=False)
    buckets = xm.all_gather_bucketized([a, b], bucket_cap_mb=0)
    return [listed, into is outs, buckets]
def expected():
    a = torch.cat([torch.full((2,), float(i)) for i in range(world)])
    b = torch.cat([torch.full((1, 2), i + 1.0) for i in range(world)])
    return {"result": [[a, b], True, [a, b]],
            "inputs": [torch.full((2,), float(index)), torch.full((1, 2), index + 1.0), a, b]}
''',
    "reduce_scatter: a tensor, scale, groups": '''
def x_of(i):
    return torch.arange(16.0).reshape(2, 8) + i
def inputs():
    return (x_of(index).to(device),)
def step(x):
    return [xm.reduce_scatter(xm.REDUCE_SUM, x, 1.0 / world, 1, world),
            xm.reduce_scatter(xm.REDUCE_MAX, x, 1.0, 0, 2, groups=[[0, 1], [2, 3]]),
            xm.reduce_scatter(xm.REDUCE_SUM, x, 1.0, 1, 2, groups=[[0, 2], [1, 3]])]
def expected():
    mean = sum(x_of(i) for i in range(world)) / world
    pair = [0, 1] if index < 2 else [2, 3]
    parity = [o for o in range(world) if o % 2 == index % 2]
    return {"result": [mean.chunk(world, 1)[index],
                       torch.stack([x_of(o) for o in pair]).max(0).values.chunk(2, 0)[index % 2],
                       sum(x_of(o) for o in parity).chunk(2, 1)[index // 2]],
            "inputs": [x_of(index)]}
''',
    "reduce_scatter: output= of the input's shape takes the shard, the same tensor returned": '''
def x_of(i):
    return torch.arange(16.0).reshape(2, 8) + i
def inputs():
    return (x_of(index).to(device), torch.zeros(2, 8).to(device))
def step(x, out):
    r = xm.reduce_scatter(xm.REDUCE_SUM, x, 1.0, 1, world, output=out)
    return [r is out]
def expected():
    return {"result": [True],
            "inputs": [x_of(index), sum(x_of(i) for i in range(world)).chunk(world, 1)[index]]}
''',
    "reduce_scatter: a list, into a list output=, bucketized": '''
def x_of(i, k):
    return torch.arange(8.0) * k + i
def inputs():
    return tuple(x_of(index, k).to(device) for k in (1, 2)) + tuple(
        torch.rand(8).to(device) for _ in range(2))
def step(a, b, out_a, out_b):
    listed = xm.reduce_scatter(xm.REDUCE_SUM, [a, b], 1.0, 0, world, pin_layout=False)
    outs = [out_a, out_b]
    into = xm.reduce_scatter(xm.REDUCE_SUM, [a, b], 0.5, 0, world, output=outs,
                             pin_layout=False)
    buckets = xm.reduce_scatter_bucketized(xm.REDUCE_SUM, [a, b], 1.0, 0, world,
                                           bucket_cap_mb=0, pin_layout=False)
    return [listed, into is outs, buckets]
def expected():
    sums = [sum(x_of(i, k) for i in range(world)).chunk(world)[index] for k in (1, 2)]
    return {"result": [sums, True, sums],
            "inputs": [x_of(index, 1), x_of(index, 2)] + [s * 0.5 for s in sums]}
''',
    "reduce_scatter: a list, pinned": '''
def inputs():
    return (torch.arange(8.0).to(device) + index, torch.ones(4).to(device))
def step(a, b):
    return xm.reduce_scatter(xm.REDUCE_SUM, [a, b], 1.0, 0, world)
def expected():
    return {"result": [sum(torch.arange(8.0) + i for i in range(world)).chunk(world)[index],
                       torch.full((1,), float(world))],
            "inputs": [torch.arange(8.0) + index, torch.ones(4)]}
''',
    "all_to_all: split and concat dims, groups": '''
def x_of(i):
    return torch.arange(8.0).reshape(4, 2) + 10 * i
def inputs():
    return (x_of(index).to(device),)
def step(x):
    return [xm.all_to_all(x, 0, 0, world), xm.all_to_all(x, 0, 1, world),
            xm.all_to_all(x, 0, 0, 2, groups=[[0, 1], [2, 3]])]
def expected():
    pair = [0, 1] if index < 2 else [2, 3]
    return {"result": [torch.cat([x_of(i).chunk(world)[index] for i in range(world)]),
                       torch.cat([x_of(i).chunk(world)[index] for i in range(world)], 1),
                       torch.cat([x_of(o).chunk(2)[index % 2] for o in pair])],
            "inputs": [x_of(index)]}
''',
    "collective_permute: a ring, and replicas no pair sends to get zeros": '''
def inputs():
    return (torch.full((2,), float(index + 1)).to(device),)
def step(x):
    ring = [[i, (i + 1) % world] for i in range(world)]
    return [xm.collective_permute(x, ring), xm.collective_permute(x, [[0, 2], [3, 1]])]
def expected():
    partial = {2: 1.0, 1: 4.0}.get(index, 0.0)
    return {"result": [torch.full((2,), float((index - 1) % world + 1)),
                       torch.full((2,), partial)],
            "inputs": [torch.full((2,), float(index + 1))]}
''',
    "collective_broadcast: the root's values, in place": '''
def inputs():
    return (torch.full((3,), float(index + 1)).to(device),
            torch.full((2,), index, dtype=torch.int32).to(device))
def step(a, b):
    return xm.collective_broadcast([a, b], root_ordinal=2)
def expected():
    return {"result": None,
            "inputs": [torch.full((3,), 3.0), torch.full((2,), 2, dtype=torch.int32)]}
''',
    "mesh_reduce, rendezvous and xla_rendezvous: every replica's payload by ordinal": '''
def step():
    return [xm.mesh_reduce("scalar", index + 0.25, sum),
            xm.mesh_reduce("tensor", torch.full((2,), float(index)),
                           lambda vs: torch.stack(vs).sum(0)),
            xm.rendezvous("bytes", bytes([index, 7])), xm.rendezvous("nothing"),
            xm.xla_rendezvous(b"x" * index)]
def expected():
    return {"result": [sum(range(world)) + 0.25 * world, torch.full((2,), float(sum(range(world)))),
                       [bytes([o, 7]) for o in range(world)], [b""] * world,
                       [b"x" * o for o in range(world)]],
            "inputs": []}
''',
    "broadcast_master_param: every replica gets replica 0's parameters and buffers": '''
def inputs():
    global model
    model = torch.nn.BatchNorm1d(2)
    with torch.no_grad():
        model.weight.fill_(index + 1.0), model.bias.fill_(-index - 1.0)
        model.running_mean.fill_(float(index))
    model = model.to(device)
    return ()
def step():
    xm.broadcast_master_param(model)
    return [model.weight, model.bias, model.running_mean]
def expected():
    return {"result": [torch.ones(2), -torch.ones(2), torch.zeros(2)], "inputs": []}
''',
    "reduce_gradients and optimizer_step: the gradients averaged, the same step": '''
def data(i):
    return torch.tensor([[float(i), 1.0], [2.0, float(i)]])
def model_of(i):
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model
def trained(reduce):
    model = model_of(index).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(data(index).to(device)).sum().backward()
    if reduce:
        xm.reduce_gradients(opt)
        grad = model.weight.grad.clone()
        opt.step()
    else:
        grad = None
        xm.optimizer_step(opt)
    return model.weight.detach(), grad
def step():
    weight, grad = trained(True)
    return [weight, grad, trained(False)[0]]
def expected():
    grad = sum(data(i).sum(0) for i in range(world)).reshape(1, 2) / world
    return {"result": [1.0 - 0.5 * grad, grad, 1.0 - 0.5 * grad], "inputs": []}
''',
}

# The torch.distributed ``xla`` backend: one process group over the cell's behaviours.
DISTRIBUTED = {
    "dist: init_process_group('xla', init_method='xla://')": '''
def step():
    dist.init_process_group("xla", init_method="xla://")
    return [dist.get_rank(), dist.get_world_size(), dist.get_backend()]
def expected():
    return {"result": [index, world, "xla"], "inputs": []}
''',
    "dist: all_reduce in place, reduce ops": '''
def inputs():
    return (torch.full((2,), float(index + 1)).to(device),
            torch.full((2,), float(index + 1)).to(device))
def step(a, b):
    dist.all_reduce(a)
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
def expected():
    return {"result": None, "inputs": [torch.full((2,), float(sum(range(1, world + 1)))),
                                       torch.full((2,), float(world))]}
''',
    "dist: all_gather into a list and all_gather_into_tensor, concatenated or stacked": '''
def inputs():
    return (torch.full((2,), float(index)).to(device),)
def step(x):
    parts = [torch.zeros(2, device=device) for _ in range(world)]
    dist.all_gather(parts, x)
    flat, stacked = torch.zeros(2 * world, device=device), torch.zeros(world, 2, device=device)
    dist.all_gather_into_tensor(flat, x)
    dist.all_gather_into_tensor(stacked, x)
    return [parts, flat, stacked]
def expected():
    parts = [torch.full((2,), float(i)) for i in range(world)]
    return {"result": [parts, torch.cat(parts), torch.stack(parts)],
            "inputs": [torch.full((2,), float(index))]}
''',
    "dist: reduce_scatter and reduce_scatter_tensor": '''
def inputs():
    return (torch.arange(2.0 * world).to(device) + index,)
def step(x):
    out = torch.zeros(2, device=device)
    dist.reduce_scatter(out, list(x.chunk(world)))
    out_t = torch.zeros(2, device=device)
    dist.reduce_scatter_tensor(out_t, x)
    return [out, out_t]
def expected():
    total = sum(torch.arange(2.0 * world) + i for i in range(world))
    return {"result": [total.chunk(world)[index]] * 2,
            "inputs": [torch.arange(2.0 * world) + index]}
''',
    "dist: broadcast, barrier": '''
def inputs():
    return (torch.full((3,), float(index)).to(device),)
def step(x):
    dist.broadcast(x, src=1)
    dist.barrier()
def expected():
    return {"result": None, "inputs": [torch.full((3,), 1.0)]}
''',
    "dist: all_to_all_single and all_to_all": '''
def inputs():
    return (torch.arange(float(world)) + 10 * index,)
def step(x):
    x = x.to(device)
    out = torch.zeros(world, device=device)
    dist.all_to_all_single(out, x)
    outs = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_to_all(outs, list(x.chunk(world)))
    return [out, outs]
def expected():
    got = torch.tensor([10.0 * i + index for i in range(world)])
    return {"result": [got, list(got.chunk(world))],
            "inputs": [torch.arange(float(world)) + 10 * index]}
''',
    "dist: reduce to one replica": '''
def inputs():
    return (torch.full((2,), float(index + 1)).to(device),)
def step(r):
    dist.reduce(r, dst=3)
def expected():
    return {"result": None,
            "inputs": [torch.full((2,), float(sum(range(1, world + 1))) if index == 3
                                  else index + 1.0)]}
''',
    "dist: gather to one replica, scatter from one": '''
def inputs():
    return (torch.full((2,), float(index)).to(device),)
def step(x):
    parts = [torch.zeros(2, device=device) for _ in range(world)] if index == 2 else None
    dist.gather(x, parts, dst=2)
    out = torch.zeros(2, device=device)
    pieces = ([torch.full((2,), 10.0 + i, device=device) for i in range(world)] if index == 1
              else None)
    dist.scatter(out, pieces, src=1)
    return [parts, out]
def expected():
    parts = [torch.full((2,), float(i)) for i in range(world)] if index == 2 else None
    return {"result": [parts, torch.full((2,), 10.0 + index)],
            "inputs": [torch.full((2,), float(index))]}
''',
    "dist: send and recv (a collective_permute of two replicas)": '''
def inputs():
    return (torch.full((2,), float(index + 1)).to(device),)
def step(x):
    if index == 0:
        dist.send(x, dst=1)
    elif index == 1:
        dist.recv(x, src=0)
def expected():
    return {"result": None, "inputs": [torch.full((2,), 1.0 if index == 1 else index + 1.0)]}
''',
    "dist: destroy_process_group": '''
def step():
    dist.destroy_process_group()
    return dist.is_initialized()
def expected():
    return {"result": False, "inputs": []}
''',
}

# XLA's CPU client compiles no Send or Recv: torch_xla's xm.send and xm.recv are refused where
# the program is compiled (the sync), on either simulation as on torch_xla alone. Last in the
# cell: the refused program is the replica's last.
SEND_RECV = {
    "send and recv: XLA:CPU compiles neither": '''
def inputs():
    return (torch.full((2,), float(index)).to(device), torch.zeros(2).to(device))
def step(x, out):
    if index == 0:
        return xm.send(x, 1)
    if index == 1:
        return xm.recv(out, 1)
    return x
def expected():
    if index in (0, 1):
        opcode = "send" if index == 0 else "recv"
        return {"error": ("ValueError", f"HLO opcode `{opcode}` is not supported by XLA:CPU "
                                        "ThunkEmitter")}
    return {"result": torch.full((2,), float(index)),
            "inputs": [torch.full((2,), float(index)), torch.zeros(2)]}
''',
}

# What a simulation cannot run as torch_xla does: name -> {simulation: why}.
CANNOT = {
    "reduce_scatter: a list, pinned": {
        "threads": "torch_xla aborts the process building it (Check failed: has_layout(), "
                   "on one CPU device too; its own tests call the case broken)"},
    "all_reduce: bfloat16": {
        "threads": "XLA:CPU compiles no all-reduce of bfloat16 ('AllReduce for datatype "
                   "'bf16' is not supported'), and the replica's program fails"},
    "all_reduce: and, or": {
        "threads": "XLA:CPU compiles no all-reduce of AND or OR ('Unsupported reduction "
                   "computation'), and the replica's program fails"},
}

# The threads of one process share torch.distributed's state, its default group included
# (docs/simulation.md). Seen here: every replica thread's init_process_group("xla") raced
# with the others' first collective (XLA aborted the process, now and then), gather and
# send/recv left replicas waiting in a collective until XLA aborted the process, and
# destroy_process_group raised AssertionError.
THREADS_SHARE_ONE_DISTRIBUTED = (
    "the replicas are threads of one process, with one torch.distributed state and default "
    "group: the xla backend is not the replicas' own there (docs/simulation.md)")
for _name in DISTRIBUTED:
    CANNOT.setdefault(_name, {})["threads"] = THREADS_SHARE_ONE_DISTRIBUTED

# The xla backend's ops that torch_xla 2.9 added (2.8's raise NotImplementedError, on a TPU
# too): behaviour -> the first release that has them.
SINCE = {name: (2, 9) for name in (
    "dist: all_to_all_single and all_to_all", "dist: reduce to one replica",
    "dist: gather to one replica, scatter from one",
    "dist: send and recv (a collective_permute of two replicas)")}
try:
    TORCH_XLA = tuple(int(part) for part in version("torch_xla").split(".")[:2])
except PackageNotFoundError:  # (a stack without torch_xla collects this module, runs none)
    TORCH_XLA = (0, 0)

# Bad arguments: name -> (source of step(), whether torch_xla alone on one device checks it
# as it does on four: xm.all_reduce on one device returns a copy, checking nothing).
ERRORS = {
    "all_gather: a list, pin_layout=True": ('xm.all_gather([x, x])', True),
    "all_gather: a list, output= not a list": ('xm.all_gather([x, x], output=x, pin_layout=False)',
                                              True),
    # torch_xla 2.9's message for this calls len() of the builtin `input`: its TypeError
    "all_gather: a list, output= of another length":
        ('xm.all_gather([x, x], output=[x], pin_layout=False)', True),
    "all_gather: a tuple": ('xm.all_gather((x, x), pin_layout=False)', True),
    "all_gather: groups of different sizes":
        ('xm.all_gather(x, groups=[[0], [1, 2, 3]], pin_layout=False)', True),
    "all_gather: a CPU output=": ('xm.all_gather(x, output=torch.zeros(4, 2))', True),
    "all_gather: a CPU tensor": ('xm.all_gather(torch.ones(2), pin_layout=False)', True),
    "reduce_scatter: a list, output= not a list":
        ('xm.reduce_scatter("sum", [x, x], 1.0, 0, world, output=x, pin_layout=False)', True),
    "reduce_scatter: a list, output= of another length":
        ('xm.reduce_scatter("sum", [x, x], 1.0, 0, world, output=[x], pin_layout=False)', True),
    "reduce_scatter: a tuple": ('xm.reduce_scatter("sum", (x, x), 1.0, 0, world)', True),
    "reduce_scatter: a CPU output=":
        ('xm.reduce_scatter("sum", x, 1.0, 0, world, output=torch.zeros(1, 2))', True),
    "reduce_scatter: an unknown reduce type": ('xm.reduce_scatter("avg", x, 1.0, 0, world)', True),
    "reduce_scatter: a CPU tensor": ('xm.reduce_scatter("sum", torch.ones(4), 1.0, 0, world)',
                                     True),
    "all_to_all: a CPU tensor": ('xm.all_to_all(torch.ones(4), 0, 0, world)', True),
    "collective_permute: a CPU tensor": ('xm.collective_permute(torch.ones(2), [[0, 0]])', True),
    "xla_rendezvous: a payload of str": ('xm.xla_rendezvous("abc")', True),
    "rendezvous: some replicas": ('xm.rendezvous("some", b"", replicas=[0, 1])', True),
    "all_reduce: a CPU tensor": ('xm.all_reduce("sum", torch.ones(2), scale=0.5)', False),
}


def _error(got):
    """An error as torch_xla's releases may word it: torch_xla 2.8's C++ errors carry where
    they were raised (``file.cpp:N : ``) and a C++ stack trace, which differ by call site."""
    if not (isinstance(got, tuple) and got[:1] == ("error",)):
        return got
    kind, message = got[1], got[2]
    message = message.rsplit("*** End stack trace ***\n", 1)[-1]
    message = re.sub(r"^\S+\.cpp:\d+ : (Check failed: \w+ ?)?", "", message)
    return ("error", kind, message.strip())


def _error_source(call: str) -> str:
    return (f"def inputs():\n    return (torch.ones(4, 2).to(device),)\n"
            f"def step(x):\n    return {call}\n")


def cell(mode: str, behaviours) -> str:
    """The cell that runs ``behaviours`` (name -> source) in ``mode``; its value is every
    behaviour's ``(got, expected)``."""
    calls = "".join(f"_behaviour({name!r}, {textwrap.dedent(source)!r})\n"
                    for name, source in behaviours.items())
    return f"MODE = {mode!r}\n{HARNESS}\n{calls}_results\n"


ip = ip_fixture(scope="module", after=lambda shell: shell.run_line_magic("unload_ext", "colab_xla"))


def spawn(ip, line: str, body: str):
    """``%%xla_spawn {line}`` of ``body`` in the shell: every replica's value, by ordinal."""
    ip.user_ns.pop("got", None)
    result = ip.run_cell(f"%%xla_spawn {line} --no-widget -o got\n{body}")
    assert result.success, result.error_in_exec
    return ip.user_ns["got"]


ALL = {**BEHAVIOURS, **DISTRIBUTED,
       **{f"error: {name}": _error_source(call) for name, (call, _) in ERRORS.items()},
       **SEND_RECV}
_runs = {}


@pytest.fixture(scope="module")
def runs(ip):
    """``(simulation, mode) -> {ordinal: {behaviour: (got, expected)}}``, one run each,
    made when first asked for; ``("alone", mode)``: the errors on torch_xla alone."""
    def get(simulation: str, mode: str):
        if (simulation, mode) not in _runs:
            _runs[simulation, mode] = None  # a run that failed fails each of its tests once
            if simulation == "alone":
                errors = {name: source for name, source in ALL.items()
                          if name.startswith("error: ") and ERRORS[name[7:]][1]}
                _runs[simulation, mode] = spawn(ip, "-n 1", cell(mode, errors))
            else:
                runnable = {name: source for name, source in ALL.items()
                            if simulation not in CANNOT.get(name, {})
                            and not (mode == "torch.compile" and name in DISTRIBUTED)}
                _runs[simulation, mode] = spawn(ip, f"-n {WORLD} --simulate {simulation}",
                                                cell(mode, runnable))
        if _runs[simulation, mode] is None:
            pytest.fail(f"the {simulation} run ({mode}) failed: see its first test")
        return _runs[simulation, mode]
    return get


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("simulation", SIMULATIONS)
@pytest.mark.parametrize("name", list(BEHAVIOURS) + list(DISTRIBUTED) + list(SEND_RECV))
def test_a_collective_gives_what_torch_xla_gives(runs, simulation, mode, name):
    if (simulation, mode) in NO_MODE:
        pytest.skip(NO_MODE[simulation, mode])
    if mode == "torch.compile" and name in DISTRIBUTED:
        pytest.skip(NOT_COMPILED)
    if simulation in CANNOT.get(name, {}):
        pytest.skip(CANNOT[name][simulation])
    results = runs(simulation, mode)
    assert set(results) == set(range(WORLD))
    for ordinal, behaviours in results.items():
        got, want = behaviours[name]
        if (TORCH_XLA < SINCE.get(name, TORCH_XLA) and isinstance(got, tuple)
                and got[:2] == ("error", "NotImplementedError")):
            continue  # torch_xla's own backend refuses it
        assert got == want, (simulation, ordinal)


@pytest.mark.parametrize("mode", ["eager"])
@pytest.mark.parametrize("simulation", SIMULATIONS)
@pytest.mark.parametrize("name", list(ERRORS))
def test_a_bad_argument_gets_torch_xlas_error(runs, simulation, mode, name):
    key = f"error: {name}"
    got = {ordinal: _error(behaviours[key][0])
           for ordinal, behaviours in runs(simulation, mode).items()}
    if ERRORS[name][1]:
        (alone,) = runs("alone", mode).values()
        want = _error(alone[key][0])
    else:
        want = _error(runs("threads", mode)[0][key][0])
    assert want[0] == "error", want
    assert got == {o: want for o in range(WORLD)}
