"""CPU replicas that really communicate: torch_xla collectives across replica threads."""

import textwrap

import pytest

from colab_xla.run import run_cell

pytestmark = [pytest.mark.xla, pytest.mark.timeout(300)]

CELL = textwrap.dedent('''
    import torch, torch_xla, torch_xla.core.xla_model as xm
    t = torch.ones(2, device=device) * index          # 0 and 1 are special scalars
    s = xm.all_reduce(xm.REDUCE_SUM, t).cpu().tolist()  # implicit sync
    g = xm.all_gather(torch.tensor([float(index)], device=device)).cpu().tolist()
    xm.rendezvous("middle")
    m = xm.mesh_reduce("m", index, sum)
    r = xm.all_reduce(xm.REDUCE_SUM, torch.tensor(1.0, device=device))
    torch_xla.sync()                                      # explicit sync
    (s, g, m, r.item())
    ''')


def test_eight_cpu_replicas_on_two_cores_communicate_every_time():
    n = 8
    expected = ([float(sum(range(n)))] * 2, [float(o) for o in range(n)], sum(range(n)), float(n))
    for attempt in range(5):  # a race shows up as a failed attempt, not as a rare flake
        outcome = run_cell(CELL, nprocs=n, announce=None, timeout=120)
        assert outcome.ok, (attempt, {o: r.error.render() for o, r in outcome.replicas.items()
                                      if r.error})
        assert outcome.results() == {o: expected for o in range(n)}, attempt
