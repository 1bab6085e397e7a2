"""Collectives under ``torch.compile(backend='openxla')`` on the CPU simulation
(:mod:`colab_xla.runtimes.traced_collectives`): what torch_xla itself lets Dynamo trace is
traced, and computed afresh at every call; the rest breaks the graph, and with
``fullgraph=True`` is refused, exactly where torch_xla's own is (checked against torch_xla
alone, one CPU device). The ``threads`` model refuses torch.compile with its reason."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from _runs import run

pytestmark = [pytest.mark.xla, pytest.mark.timeout(600), pytest.mark.stacks("colab", "kaggle")]

# Each form: one call on v, a float tensor of 4 on the replica's device. A step doubles its
# input first and adds 1 after, so that the collective sits inside the graph.
FORMS = {
    "all_reduce": 'xm.all_reduce(xm.REDUCE_SUM, v)',
    "all_reduce max": 'xm.all_reduce(xm.REDUCE_MAX, v)',
    "all_reduce scale": 'xm.all_reduce(xm.REDUCE_SUM, v, scale=0.5)',
    "all_reduce groups": 'xm.all_reduce(xm.REDUCE_SUM, v, groups=GROUPS)',
    "all_reduce list": 'xm.all_reduce(xm.REDUCE_SUM, [v, v + 1])[1]',
    "all_reduce unpinned": 'xm.all_reduce(xm.REDUCE_SUM, v, pin_layout=False)',
    "all_gather": 'xm.all_gather(v)',
    "all_gather groups": 'xm.all_gather(v, groups=GROUPS)',
    "all_gather unpinned": 'xm.all_gather(v, pin_layout=False)',
    "reduce_scatter": 'xm.reduce_scatter(xm.REDUCE_SUM, v, 1.0, 0, WORLD)',
    "all_to_all": 'xm.all_to_all(v, 0, 0, WORLD)',
    "collective_permute": 'xm.collective_permute(v, PAIRS)',
}

# Runs FORMS in `mode` and returns, for each, its values at three calls or the error's type.
HARNESS = '''
import json, torch, torch_xla, torch_xla.core.xla_model as xm, torch_xla.runtime as xr
WORLD = xr.world_size()
GROUPS = [list(range(WORLD))]
PAIRS = [[r, (r + 1) % WORLD] for r in range(WORLD)]
FORMS = json.loads({forms!r})

def attempt(source, fullgraph):
    step = eval("lambda x: (lambda v: " + source + ")(x * 2) + 1")
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="openxla", fullgraph=fullgraph)
    try:
        return [compiled(torch.full((4,), float(xr.global_ordinal() + 10 * call),
                                    device=torch_xla.device())).cpu().tolist()
                for call in range(3)]
    except Exception as e:
        return type(e).__name__

{{(name, fullgraph): attempt(source, fullgraph)
  for name, source in FORMS.items() for fullgraph in (True, False)}}
'''


def _eager_value(name: str, ordinal: int, world: int, call: int):
    """What torch_xla computes for FORMS[name] at ``call`` on replica ``ordinal``."""
    mine = [2.0 * (o + 10 * call) for o in range(world)]  # each replica's x * 2
    if name in ("all_reduce", "all_reduce groups", "all_reduce unpinned"):
        return [sum(mine) + 1] * 4
    if name == "all_reduce max":
        return [max(mine) + 1] * 4
    if name == "all_reduce scale":
        return [sum(mine) * 0.5 + 1] * 4
    if name == "all_reduce list":
        return [sum(m + 1 for m in mine) + 1] * 4
    if name.startswith("all_gather"):
        return [v + 1 for m in mine for v in [m] * 4]
    if name == "reduce_scatter":
        return [sum(mine) + 1] * (4 // world)
    if name == "all_to_all":
        return [m + 1 for m in mine for _ in range(4 // world)]
    if name == "collective_permute":
        return [mine[(ordinal - 1) % world] + 1] * 4
    raise KeyError(name)


@pytest.fixture(scope="module")
def untraceable_in_torch_xla():
    """The forms torch_xla alone (one CPU device, every collective really called) cannot
    trace with fullgraph=True: its own Python path, the same as on a TPU of one process per
    chip, where world size and ordinal are known before the first compile."""
    code = textwrap.dedent(f'''
        import json, os
        os.environ["PJRT_DEVICE"] = "CPU"; os.environ["XLA_ALWAYS_ALLREDUCE"] = "1"
        import torch, torch_xla, torch_xla.core.xla_model as xm, torch_xla.runtime as xr
        xr._init_world_size_ordinal()  # as xmp.spawn does in each process of a TPU host
        out = {{}}
        for name, source in json.loads({json.dumps(FORMS)!r}).items():
            source = (source.replace("GROUPS", "[[0]]").replace("WORLD", "1")
                      .replace("PAIRS", "[[0, 0]]"))
            torch._dynamo.reset()
            step = torch.compile(eval("lambda v: " + source), backend="openxla",
                                 fullgraph=True)
            try:
                step(torch.ones(4, device=torch_xla.device())).cpu()
                out[name] = None
            except Exception as e:
                out[name] = type(e).__name__
        print(json.dumps(out))
    ''')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = json.loads(done.stdout.splitlines()[-1])
    return {name for name, error in refused.items() if error}


def test_compiled_collectives_compute_at_every_call_and_refuse_where_torch_xla_does(
        untraceable_in_torch_xla):
    world = 2
    assert untraceable_in_torch_xla == set(FORMS) - {
        "all_reduce", "all_reduce max", "all_gather"}  # what torch_xla 2.9 traces
    outcome = run(HARNESS.format(forms=json.dumps(FORMS)), world)
    assert outcome.ok, {o: r.error.render() for o, r in outcome.replicas.items() if r.error}
    for ordinal, results in outcome.results().items():
        for name in FORMS:
            expected = [_eager_value(name, ordinal, world, call) for call in range(3)]
            # With a graph break, every form runs, and runs as it does eagerly.
            assert results[name, False] == expected, (ordinal, name)
            if name in untraceable_in_torch_xla:
                assert results[name, True] == "Unsupported", (ordinal, name)
            else:  # traced, yet computed again at each call (not a constant of the graph)
                assert results[name, True] == expected, (ordinal, name)


def test_the_xla_backends_collectives_inside_a_compiled_step():
    # Dynamo turns dist.all_reduce and friends into torch's functional collectives, which
    # torch_xla lowers into the graph: a world of one on a simulated replica's device.
    cell = '''
    import torch, torch_xla, torch.distributed as dist
    import torch_xla.distributed.xla_backend
    dist.init_process_group("xla", init_method="xla://")
    def reduce(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1
    def gather(x):
        y = torch.empty(2 * x.numel(), device=x.device)
        dist.all_gather_into_tensor(y, x * 2)
        return y + 1
    def scatter(x):
        y = torch.empty(x.numel() // 2, device=x.device)
        dist.reduce_scatter_tensor(y, x * 2)
        return y + 1
    def broadcast(x):
        y = x * 2
        dist.broadcast(y, src=1)
        return y + 1
    steps = [torch.compile(f, backend="openxla") for f in (reduce, gather, scatter, broadcast)]
    [[step(torch.full((2,), float(index + 10 * call), device=device)).cpu().tolist()
      for step in steps] for call in range(2)]
    '''
    outcome = run(cell, 2)
    assert outcome.ok, {o: r.error.render() for o, r in outcome.replicas.items() if r.error}
    for ordinal, calls in outcome.results().items():
        for call, (reduced, gathered, scattered, broadcast) in enumerate(calls):
            mine = [2.0 * (o + 10 * call) for o in range(2)]
            assert reduced == [sum(mine) + 1] * 2, (ordinal, call)
            assert gathered == [mine[0] + 1] * 2 + [mine[1] + 1] * 2, (ordinal, call)
            assert scattered == [sum(mine) + 1], (ordinal, call)
            assert broadcast == [mine[1] + 1] * 2, (ordinal, call)


def test_threads_refuse_torch_compile_with_the_reason_and_the_way_out():
    from colab_xla.runtimes.cpu_sim import THREADS_NO_DYNAMO

    cell = '''
    import torch, torch_xla.core.xla_model as xm
    step = torch.compile(lambda x: xm.all_reduce(xm.REDUCE_SUM, x * 2) + 1, backend="openxla")
    step(torch.ones(2, device=device))
    '''
    outcome = run(cell, 2, simulate="threads")
    assert not outcome.ok
    for ordinal, replica in outcome.replicas.items():
        assert replica.error is not None, ordinal
        assert "BackendCompilerFailed" in replica.error.render(), ordinal
        assert THREADS_NO_DYNAMO[:60] in replica.error.render(), ordinal
