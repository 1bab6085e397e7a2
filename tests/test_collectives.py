"""CPU replicas that really communicate: torch_xla collectives across replica threads."""

import textwrap

import pytest

from colab_xla.notebook.targets import run_cell

pytestmark = [pytest.mark.xla, pytest.mark.timeout(300), pytest.mark.stacks("kaggle")]

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
        outcome = run_cell(CELL, replicas=n, announce=None, timeout=120)
        assert outcome.ok, (attempt, {o: r.error.render() for o, r in outcome.replicas.items()
                                      if r.error},
                            {label: log.tail_text()[-6000:]  # a native crash's stacks
                             for label, log in outcome.processes.items()})
        assert outcome.results() == {o: expected for o in range(n)}, attempt


TRAIN = textwrap.dedent('''
    import copy, torch, torch.nn.functional as F
    import torch_xla.core.xla_model as xm, torch_xla.distributed.parallel_loader as pl
    from torch_xla.utils.utils import SampleGenerator
    model = copy.deepcopy(BASE).to(device)      # the same start on every replica
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    data = SampleGenerator(data=(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))),
                           sample_count=6)
    for step, (x, y) in enumerate(pl.MpDeviceLoader(data, device)):
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        xm.optimizer_step(opt)                    # all_reduce of the gradients
        print(f"step {step} loss {loss.item():.4f}")
    {name: p.detach() for name, p in model.named_parameters()}
    ''')


def test_a_training_loop_with_optimizer_step_keeps_eight_replicas_identical():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(1, 4, 5), nn.BatchNorm2d(4)
            self.fc = nn.Linear(4 * 12 * 12, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
            return F.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)

    torch.manual_seed(0)
    base = Net()
    for attempt in range(3):
        outcome = run_cell(TRAIN, replicas=8, announce=None, timeout=240, user_ns={"BASE": base})
        assert outcome.ok, (attempt, {o: r.error.render() for o, r in outcome.replicas.items()
                                      if r.error},
                            {label: log.tail_text()[-6000:]  # a native crash's stacks
                             for label, log in outcome.processes.items()})
        params = outcome.results()
        for o in range(8):
            assert [line.split(" loss")[0] for line in outcome.replicas[o].text.splitlines()] \
                == [f"step {s}" for s in range(6)]
            for name, value in params[o].items():  # gradients were averaged: same weights
                assert torch.equal(value, params[0][name]), (attempt, o, name)
        assert not torch.equal(params[0]["fc.weight"], base.fc.weight.detach())  # it trained


PLAIN_LOOP = textwrap.dedent('''
    import torch, torch_xla.core.xla_model as xm
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():                             # the same start on every replica
        model.weight.fill_(0.5), model.bias.fill_(0.0)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(index)          # different data on every replica
    for step in range(5):
        x = torch.randn(8, 2, generator=g)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), x.sum(1, keepdim=True).to(device))
        opt.zero_grad()
        loss.backward()
        xm.optimizer_step(opt)                        # no torch_xla.sync() after it
        print(f"step {step} loss {loss.item():.4f}")  # .item() runs the step
    [p.detach() for p in model.parameters()]
    ''')


def test_a_plain_loop_without_a_sync_after_the_step_trains_every_replica_alike():
    # With XLA's parameter buffer donation on, the second step met a deleted buffer.
    import torch

    outcome = run_cell(PLAIN_LOOP, replicas=4, announce=None, timeout=120)
    assert outcome.ok, {o: r.error.render() for o, r in outcome.replicas.items() if r.error}
    params = outcome.results()
    for o in range(4):
        assert len(outcome.replicas[o].text.splitlines()) == 5
        assert all(torch.equal(a, b) for a, b in zip(params[o], params[0])), o
    assert float(params[0][1]) != 0.0  # it trained
