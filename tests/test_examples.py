"""Public PyTorch/XLA examples, migrated into a cell as a user would, on the default CPU
simulation (one process per replica, collectives through gloo).

The migration each cell makes: the body of ``_mp_fn`` pasted into the cell, ``index`` in
place of its index argument, sizes down to what two cores train in seconds, synthetic data
in place of downloads; the APIs the example uses are kept. Where a TPU gives every replica
the same weights, the cell returns them and the test asserts they are the same on every
replica, and that training did something.

The sources (pytorch/xla at v2.9.0 unless said):
- ``test/test_train_mp_mnist.py --ddp``;
- ``contrib/kaggle/distributed-pytorch-xla-basics-with-pjrt.ipynb`` (its ``toy_model``);
- ``docs/source/perf/ddp.md`` (``demo_basic``);
- ``contrib/colab/mnist-training.ipynb`` (before the Colab notebooks were removed, #6155):
  ``xmp.MpModelWrapper`` at notebook scope, ``DataLoader(num_workers=...)`` with a
  ``DistributedSampler``, ``pl.ParallelLoader``;
- ``examples/eager/train_decoder_only_eager_multi_process.py``;
- ``examples/data_parallel/train_resnet_xla_ddp.py`` (with ``examples/train_resnet_base.py``);
- huggingface/accelerate's notebook examples (``training_loop`` with ``Accelerator``).
"""

import pytest

from _runs import run

pytestmark = [pytest.mark.xla, pytest.mark.timeout(240)]


def _why(outcome):
    """What a failed run said: every replica's error, and the end of every process's log."""
    return ({o: r.error.render() for o, r in outcome.replicas.items() if r.error},
            {label: log.tail_text()[-4000:] for label, log in outcome.processes.items()})


def _ok(outcome, n):
    assert outcome.ok, _why(outcome)
    results = outcome.results()
    assert sorted(results) == list(range(n)), results
    return results


def _assert_same_weights(results, key=None):
    """Every replica's weights (a name -> tensor dict, or under ``key`` of one) equal
    replica 0's, exactly."""
    import torch

    first = results[0] if key is None else results[0][key]
    assert first, "no weights returned"
    for o, value in results.items():
        weights = value if key is None else value[key]
        assert weights.keys() == first.keys(), o
        for name, tensor in weights.items():
            assert torch.equal(tensor, first[name]), (o, name, (tensor - first[name]).abs().max())


def _assert_changed(before, after):
    import torch

    assert any(not torch.equal(before[name], after[name]) for name in after), \
        "no weight changed: it did not train"


# 1. test/test_train_mp_mnist.py --ddp --fake_data ---------------------------------------

MNIST_DDP = '''
    import numpy as np
    import torch, torch.nn as nn, torch.nn.functional as F, torch.optim as optim
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.utils.utils as xu
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch_xla.distributed.xla_backend
    from torch_xla import runtime as xr

    class MNIST(nn.Module):
      def __init__(self):
        super(MNIST, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.bn1 = nn.BatchNorm2d(10)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(20)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

      def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.bn1(x)
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = self.bn2(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)

    batch_size, num_epochs, log_steps = 16, 2, 1
    dist.init_process_group('xla', init_method='xla://')
    torch.manual_seed(1)
    # fake data: the same batch every step (xu.SampleGenerator), different on every replica
    g = torch.Generator().manual_seed(100 + xr.global_ordinal())
    images = torch.randn(batch_size, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (batch_size,), generator=g)
    train_loader = xu.SampleGenerator(data=(images, labels),
                                      sample_count=64 // batch_size // xr.world_size())
    test_loader = xu.SampleGenerator(data=(images, labels), sample_count=1)

    lr = 0.01 * xr.world_size()
    device = torch_xla.device()
    model = MNIST().to(device)
    xm.broadcast_master_param(model)
    model = DDP(model, gradient_as_bucket_view=True)
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    loss_fn = nn.NLLLoss()
    losses = []

    def _train_update(device, step, loss, tracker, epoch):
      losses.append(loss.item())
      print(f'[{device}] epoch {epoch} step {step} loss {loss.item():.5f} '
            f'rate {tracker.rate():.2f}')

    def train_loop_fn(loader, epoch):
      tracker = xm.RateTracker()
      model.train()
      for step, (data, target) in enumerate(loader):
        optimizer.zero_grad()
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()                       # under --ddp; DDP all-reduced the gradients
        tracker.add(batch_size)
        if step % log_steps == 0:
          xm.add_step_closure(_train_update, args=(device, step, loss, tracker, epoch))

    def test_loop_fn(loader):
      total_samples = 0
      correct = 0
      model.eval()
      for data, target in loader:
        output = model(data)
        pred = output.max(1, keepdim=True)[1]
        correct += pred.eq(target.view_as(pred)).sum()
        total_samples += data.size()[0]
      accuracy = 100.0 * correct.item() / total_samples
      accuracy = xm.mesh_reduce('test_accuracy', accuracy, np.mean)
      return accuracy

    train_device_loader = pl.MpDeviceLoader(train_loader, device)
    test_device_loader = pl.MpDeviceLoader(test_loader, device)
    for epoch in range(1, num_epochs + 1):
      xm.master_print('Epoch {} train begin'.format(epoch))
      train_loop_fn(train_device_loader, epoch)
      accuracy = test_loop_fn(test_device_loader)
      xm.master_print('Epoch {} test end, Accuracy={:.2f}'.format(epoch, accuracy))

    {"weights": {k: v.detach().cpu() for k, v in model.module.named_parameters()},
     "losses": losses, "accuracy": accuracy}
    '''


def test_mnist_ddp_from_test_train_mp_mnist():
    n = 2  # the full MNIST net under DDP: 4 replicas take ~45 s on two cores
    results = _ok(run(MNIST_DDP, n, timeout=180), n)
    _assert_same_weights(results, "weights")
    for o, value in results.items():
        losses = value["losses"]
        assert len(losses) == 4, (o, losses)          # 2 steps an epoch, 2 epochs
        assert losses[-1] < losses[0], (o, losses)     # the same batch again: it learned
        assert value["accuracy"] == results[0]["accuracy"]  # mesh_reduce: one answer


# 2. Kaggle's "distributed PyTorch/XLA basics" toy_model -------------------------------

KAGGLE_DDP = '''
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch.optim as optim
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_backend # Registers `xla://` init_method
    import torch_xla.experimental.pjrt_backend # Required for torch.distributed on TPU v2 and v3

    device = torch_xla.device()
    dist.init_process_group('xla', init_method='xla://')

    # Initialize a basic toy model
    torch.manual_seed(42)
    model = nn.Linear(128, 10).to(device)
    initial = {k: v.detach().cpu().clone() for k, v in model.named_parameters()}

    # Optional for TPU v4
    xm.broadcast_master_param(model)

    model = DDP(model, gradient_as_bucket_view=True)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=.001)

    for i in range(10):
        # Generate random inputs and outputs on the XLA device
        data, target = torch.randn((128, 128), device=device), torch.randn((128, 10), device=device)

        optimizer.zero_grad()
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()

        optimizer.step()

        # Run the pending graph
        torch_xla.sync()

    # Print mean parameters so we can confirm they're the same across replicas
    print(index, [p.mean() for p in model.parameters()])
    {"initial": initial,
     "weights": {k: v.detach().cpu() for k, v in model.module.named_parameters()},
     "group": (dist.get_rank(), dist.get_world_size())}
    '''


@pytest.mark.stacks("kaggle")
def test_kaggle_ddp_toy_model():
    # Only the processes model: with simulate="threads" the four replica threads share one
    # torch.distributed default group, and their init_process_group calls race: either one
    # raises "trying to initialize the default process group twice!", or all pass the check
    # and the last one's group wins (dist.get_rank() is then 3 on every replica).
    n = 4
    outcome = run(KAGGLE_DDP, n, timeout=120)
    results = _ok(outcome, n)
    _assert_same_weights(results, "weights")
    _assert_changed(results[0]["initial"], results[0]["weights"])
    assert {o: value["group"] for o, value in results.items()} == {o: (o, n) for o in range(n)}
    for o in range(n):  # (after DDP's C++ warning about time stats on non-CPU/CUDA devices)
        assert f"\n{o} [tensor(" in "\n" + outcome.replicas[o].text, outcome.replicas[o].text


# 3. docs/source/perf/ddp.md: demo_basic -------------------------------------------------

DDP_DOC = '''
    import os
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.optim as optim
    from torch.nn.parallel import DistributedDataParallel as DDP

    # additional imports for xla
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    import torch_xla.distributed.xla_backend

    def setup(rank, world_size):
        # (the doc sets os.environ['PJRT_DEVICE'] = 'TPU' here: dropped, as on CPU)
        # initialize the xla process group
        dist.init_process_group("xla", rank=rank, world_size=world_size)

    def cleanup():
        dist.destroy_process_group()

    class ToyModel(nn.Module):
        def __init__(self):
            super(ToyModel, self).__init__()
            self.net1 = nn.Linear(10, 1000)       # 1000000 in the doc
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(1000, 5)

        def forward(self, x):
            return self.net2(self.relu(self.net1(x)))

    rank = index
    # xla specific APIs to get rank, world_size.
    new_rank = xr.global_ordinal()
    assert new_rank == rank
    world_size = xr.world_size()

    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # create model and move it to XLA device
    device = torch_xla.device()
    model = ToyModel().to(device)
    initial = {k: v.detach().cpu().clone() for k, v in model.named_parameters()}
    ddp_model = DDP(model, gradient_as_bucket_view=True)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10).to(device))
    labels = torch.randn(20, 5).to(device)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    # xla specific API to execute the graph
    torch_xla.sync()

    cleanup()
    {"initial": initial, "weights": {k: v.detach().cpu() for k, v in model.named_parameters()}}
    '''


@pytest.mark.stacks("kaggle")
def test_ddp_doc_demo_basic():
    n = 4
    outcome = run(DDP_DOC, n, timeout=120)
    results = _ok(outcome, n)
    # No broadcast in the doc: the same start because every replica's generator starts
    # alike (as fresh processes on a TPU host do).
    _assert_same_weights(results, "initial")
    _assert_same_weights(results, "weights")
    _assert_changed(results[0]["initial"], results[0]["weights"])
    for o in range(n):
        assert f"Running basic DDP example on rank {o}." in outcome.replicas[o].text


# 4. contrib/colab/mnist-training.ipynb: MpModelWrapper, DataLoader workers ---------------

COLAB_MNIST = '''
    import time
    import torch, torch.nn as nn, torch.optim as optim
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr

    torch.manual_seed(1)
    train_dataset = SERIAL_EXEC.run(get_dataset)

    train_sampler = torch.utils.data.distributed.DistributedSampler(
      train_dataset,
      num_replicas=xr.world_size(),
      rank=xr.global_ordinal(),
      shuffle=True)
    train_loader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=FLAGS['batch_size'],
        sampler=train_sampler,
        num_workers=FLAGS['num_workers'],
        drop_last=True)

    # Scale learning rate to world size
    lr = FLAGS['learning_rate'] * xr.world_size()

    # Get loss function, optimizer, and model
    device = xm.xla_device()
    model = WRAPPED_MODEL.to(device)
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=FLAGS['momentum'])
    loss_fn = nn.NLLLoss()
    losses = []

    def train_loop_fn(loader):
      tracker = xm.RateTracker()
      model.train()
      for x, (data, target) in enumerate(loader):
        optimizer.zero_grad()
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()
        xm.optimizer_step(optimizer)
        tracker.add(FLAGS['batch_size'])
        if x % FLAGS['log_steps'] == 0:
          losses.append(loss.item())
          print('[xla:{}]({}) Loss={:.5f} Rate={:.2f} GlobalRate={:.2f} Time={}'.format(
              xr.global_ordinal(), x, loss.item(), tracker.rate(),
              tracker.global_rate(), time.asctime()), flush=True)

    for epoch in range(1, FLAGS['num_epochs'] + 1):
      train_sampler.set_epoch(epoch)
      para_loader = pl.ParallelLoader(train_loader, [device])
      train_loop_fn(para_loader.per_device_loader(device))
      xm.master_print("Finished training epoch {}".format(epoch))

    {"weights": {k: v.detach().cpu() for k, v in model.named_parameters()}, "losses": losses}
    '''


@pytest.mark.stacks("kaggle")
def test_colab_mpmodelwrapper_and_dataloader_workers():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch_xla.distributed.xla_multiprocessing as xmp

    class MNIST(nn.Module):  # the notebook's, narrower
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
            self.bn1 = nn.BatchNorm2d(4)
            self.fc1 = nn.Linear(4 * 12 * 12, 10)

        def forward(self, x):
            x = self.bn1(F.relu(F.max_pool2d(self.conv1(x), 2)))
            return F.log_softmax(self.fc1(torch.flatten(x, 1)), dim=1)

    def get_dataset():  # in place of datasets.MNIST(download=True): learnable fake digits
        g = torch.Generator().manual_seed(0)
        labels = torch.randint(0, 10, (256,), generator=g)
        images = torch.randn(256, 1, 28, 28, generator=g) * 0.1
        images[torch.arange(256), 0, labels, labels] += 3.0  # the label drawn as a pixel
        return torch.utils.data.TensorDataset(images, labels)

    torch.manual_seed(0)
    model = MNIST()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    user_ns = {
        "FLAGS": {"batch_size": 16, "num_workers": 2, "learning_rate": 0.01, "momentum": 0.5,
                  "num_epochs": 2, "log_steps": 1},
        # Only instantiate model weights once in memory.
        "WRAPPED_MODEL": xmp.MpModelWrapper(model),
        "SERIAL_EXEC": xmp.MpSerialExecutor(),
        "get_dataset": get_dataset,
    }
    n = 4
    results = _ok(run(COLAB_MNIST, n, timeout=180, user_ns=user_ns), n)
    _assert_same_weights(results, "weights")
    _assert_changed(initial, results[0]["weights"])
    for o, value in results.items():
        losses = value["losses"]
        assert len(losses) == 8, (o, losses)  # 256 / 4 replicas / 16 a batch = 4 steps, 2 epochs
        assert sum(losses[-4:]) < sum(losses[:4]), (o, losses)


# 5. examples/eager/train_decoder_only_eager_multi_process.py ------------------------------

EAGER = '''
    import itertools
    import torch, torch.nn as nn
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.utils.utils as xu
    from torch_xla import runtime as xr

    class TinyDecoder(nn.Module):         # in place of decoder_only_model.DecoderOnlyModel
      def __init__(self, vocab_size=32, hidden_size=16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.GELU())
        self.lm_head = nn.Linear(hidden_size, vocab_size)

      def forward(self, ids):
        return self.lm_head(self.mlp(self.embed(ids)))

    class TrainDecoderOnlyBase:
      def __init__(self, num_steps=6):
        self.vocab_size = 32
        self.batch_size = 4
        self.seq_len = 8
        self.num_steps = num_steps
        self.num_epochs = 1
        self.train_dataset_len = 96
        # For the purpose of this example, we are going to use fake data.
        train_loader = xu.SampleGenerator(
            data=(torch.zeros(self.batch_size, self.seq_len, dtype=torch.int64),
                  torch.zeros(self.batch_size, self.seq_len, dtype=torch.int64)),
            sample_count=self.train_dataset_len // self.batch_size)
        self.device = torch_xla.device()
        self.train_device_loader = pl.MpDeviceLoader(train_loader, self.device)
        self.model = TinyDecoder(self.vocab_size).to(self.device)
        self.initial = {k: v.detach().cpu().clone() for k, v in self.model.named_parameters()}
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.loss_fn = nn.CrossEntropyLoss()
        self.compiled_step_fn = torch_xla.compile(
            self.step_fn, full_graph=True, name="decoder_step_fn")
        self.losses = []

      def _train_update(self, step, loss, tracker, epoch):
        self.losses.append(loss.item())
        print(f'epoch: {epoch}, step: {step}, loss: {loss}, rate: {tracker.rate()}')
        assert not torch.isnan(loss).item(), "Loss became NaN!"

      def run_optimizer(self):
        self.optimizer.step()

      def step_fn(self, data, target):
        self.optimizer.zero_grad()
        logits = self.model(data)
        loss = self.loss_fn(logits.view(-1, self.vocab_size), target.view(-1))
        loss.backward()
        self.run_optimizer()
        return loss

      def train_loop_fn(self, loader, epoch):
        tracker = xm.RateTracker()
        self.model.train()
        loader = itertools.islice(loader, self.num_steps)
        for step, (data, target) in enumerate(loader):
          loss = self.compiled_step_fn(data, target)
          tracker.add(self.batch_size)
          if step % 2 == 0:
            xm.add_step_closure(self._train_update, args=(step, loss, tracker, epoch))

      def start_training(self):
        for epoch in range(1, self.num_epochs + 1):
          xm.master_print('Epoch {} train begin'.format(epoch))
          self.train_loop_fn(self.train_device_loader, epoch)
          xm.master_print('Epoch {} train end'.format(epoch))
        xm.wait_device_ops()

    class TrainDecoderXLADDP(TrainDecoderOnlyBase):
      def __init__(self):
        super().__init__()
        # We want to run the step fn eagerly.
        self.compiled_step_fn = self.step_fn

      def run_optimizer(self):
        # optimizer_step will call `optimizer.step()` and all_reduce the gradident
        xm.optimizer_step(self.optimizer)

    torch_xla.experimental.eager_mode(True)
    xla_ddp = TrainDecoderXLADDP()
    xla_ddp.start_training()
    {"initial": xla_ddp.initial, "losses": xla_ddp.losses,
     "eager": torch_xla.experimental.is_eager_mode(),
     "weights": {k: v.detach().cpu() for k, v in xla_ddp.model.named_parameters()}}
    '''


@pytest.mark.stacks("kaggle")
def test_eager_multi_process_decoder():
    n = 4
    results = _ok(run(EAGER, n, timeout=180), n)
    _assert_same_weights(results, "initial")
    _assert_same_weights(results, "weights")
    _assert_changed(results[0]["initial"], results[0]["weights"])
    for o, value in results.items():
        assert value["eager"], o
        assert len(value["losses"]) == 3 and value["losses"][-1] < value["losses"][0], (o, value)


# 6. examples/data_parallel/train_resnet_xla_ddp.py ----------------------------------------

RESNET_XLA_DDP = '''
    import itertools, time
    import torch, torch.nn as nn, torch.optim as optim
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.utils.utils as xu
    from torch_xla import runtime as xr

    def tiny_convnet(num_classes=10):           # in place of torchvision.models.resnet50()
      return nn.Sequential(
          nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
          nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))

    class TrainResNetBase():
      def __init__(self):
        self.img_dim = 16
        self.batch_size = 8
        self.num_steps = 6
        self.num_epochs = 1
        self.train_dataset_len = 192
        # For the purpose of this example, we are going to use fake data.
        train_loader = xu.SampleGenerator(
            data=(torch.zeros(self.batch_size, 3, self.img_dim, self.img_dim),
                  torch.zeros(self.batch_size, dtype=torch.int64)),
            sample_count=self.train_dataset_len // self.batch_size //
            xr.world_size())
        self.device = torch_xla.device()
        self.train_device_loader = pl.MpDeviceLoader(train_loader, self.device)
        self.model = tiny_convnet().to(self.device)
        self.initial = {k: v.detach().cpu().clone() for k, v in self.model.named_parameters()}
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.1, weight_decay=1e-4)
        self.loss_fn = nn.CrossEntropyLoss()
        self.compiled_step_fn = torch_xla.compile(
            self.step_fn, full_graph=True, name="resnet_step_fn")
        self.losses = []

      def _train_update(self, step, loss, tracker, epoch):
        self.losses.append(loss.item())
        print(f'epoch: {epoch}, step: {step}, loss: {loss}, rate: {tracker.rate()}')

      def run_optimizer(self):
        self.optimizer.step()

      def step_fn(self, data, target):
        self.optimizer.zero_grad()
        output = self.model(data)
        loss = self.loss_fn(output, target)
        loss.backward()
        self.run_optimizer()
        return loss

      def train_loop_fn(self, loader, epoch):
        tracker = xm.RateTracker()
        self.model.train()
        loader = itertools.islice(loader, self.num_steps)
        for step, (data, target) in enumerate(loader):
          loss = self.compiled_step_fn(data, target)
          tracker.add(self.batch_size)
          if step % 2 == 0:
            xm.add_step_closure(self._train_update, args=(step, loss, tracker, epoch))

      def start_training(self):
        for epoch in range(1, self.num_epochs + 1):
          xm.master_print('Epoch {} train begin {}'.format(
              epoch, time.strftime('%l:%M%p %Z on %b %d, %Y')))
          self.train_loop_fn(self.train_device_loader, epoch)
          xm.master_print('Epoch {} train end {}'.format(
              epoch, time.strftime('%l:%M%p %Z on %b %d, %Y')))
        xm.wait_device_ops()

    class TrainResNetXLADDP(TrainResNetBase):
      def run_optimizer(self):
        # optimizer_step will call `optimizer.step()` and all_reduce the gradident
        xm.optimizer_step(self.optimizer)

    # cache init needs to happens inside the mp_fn.
    xr.initialize_cache(f'{CACHE_DIR}/xla_cache_{index}', readonly=False)
    xla_ddp = TrainResNetXLADDP()
    xla_ddp.start_training()
    {"initial": xla_ddp.initial, "losses": xla_ddp.losses,
     "weights": {k: v.detach().cpu() for k, v in xla_ddp.model.named_parameters()}}
    '''


@pytest.mark.stacks("kaggle")
def test_resnet_xla_ddp_with_compiled_step(tmp_path):
    n = 4
    outcome = run(RESNET_XLA_DDP, n, timeout=180, user_ns={"CACHE_DIR": str(tmp_path)})
    results = _ok(outcome, n)
    _assert_same_weights(results, "initial")
    _assert_same_weights(results, "weights")
    _assert_changed(results[0]["initial"], results[0]["weights"])
    for o, value in results.items():
        assert len(value["losses"]) == 3 and value["losses"][-1] < value["losses"][0], (o, value)
    # xm.master_print: replica 0 only. (Its text is not asserted: master_print's default
    # ``fd=sys.stdout`` is bound when xla_model is imported, here under pytest's capture,
    # whose file is not fd 1; in a notebook it is ipykernel's stream, which replicas redirect.)
    for o in range(1, n):
        assert "Epoch 1 train" not in outcome.replicas[o].text, o


# 7. accelerate, notebook style ----------------------------------------------------------

ACCELERATE = '''
    import torch, torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    def get_dataloaders(batch_size):
        g = torch.Generator().manual_seed(0)        # the same dataset on every replica
        x = torch.randn(512, 2, generator=g)
        y = (x[:, 0] + x[:, 1] > 0).long()          # separable
        train = TensorDataset(x[:384], y[:384])
        test = TensorDataset(x[384:], y[384:])
        return (DataLoader(train, shuffle=True, batch_size=batch_size),
                DataLoader(test, shuffle=False, batch_size=batch_size))

    def training_loop(seed: int = 42, batch_size: int = 16, epochs: int = 2):
        set_seed(seed)
        accelerator = Accelerator(mixed_precision="no")
        train_dataloader, eval_dataloader = get_dataloaders(batch_size)
        model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
        model = model.to(accelerator.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        criterion = nn.CrossEntropyLoss()
        model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader)
        for epoch in range(epochs):
            model.train()
            for inputs, targets in train_dataloader:
                outputs = model(inputs)
                loss = criterion(outputs, targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            model.eval()
            accurate, num_elems = 0, 0
            for inputs, targets in eval_dataloader:
                with torch.no_grad():
                    outputs = model(inputs)
                predictions = outputs.argmax(dim=-1)
                accurate_preds = accelerator.gather(predictions) == accelerator.gather(targets)
                num_elems += accurate_preds.shape[0]
                accurate += accurate_preds.long().sum()
            eval_metric = accurate.item() / num_elems
            accelerator.print(f"epoch {epoch}: {100 * eval_metric:.2f}")
        state = accelerator.state
        weights = accelerator.unwrap_model(model).state_dict()
        return {"distributed_type": str(state.distributed_type),
                "num_processes": state.num_processes,
                "process_index": state.process_index, "device": str(accelerator.device),
                "accuracy": eval_metric, "eval_count": num_elems,
                "weights": {k: v.detach().cpu() for k, v in weights.items()}}

    training_loop()
    '''


def test_accelerate_training_loop():
    pytest.importorskip("accelerate")  # in the dev environment (requirements-dev.txt)
    n = 4
    outcome = run(ACCELERATE, n, timeout=180)
    results = _ok(outcome, n)
    _assert_same_weights(results, "weights")
    for o, value in results.items():
        assert value["distributed_type"] == "DistributedType.XLA", value
        assert (value["num_processes"], value["process_index"]) == (n, o), value
        assert value["device"].startswith("xla"), value
        assert value["eval_count"] == 128, value     # gathered: the whole test set
        assert value["accuracy"] > 0.8, value         # chance is 0.5


LOCAL_MAIN = '''
    from accelerate import Accelerator
    accelerator = Accelerator()
    accelerator.print("printed by the local main process")
    (accelerator.local_process_index, accelerator.is_local_main_process)
    '''


# accelerate (state.py, PartialState.__init__) takes local_process_index from
# xm.get_local_ordinal() only on a TPU; on CPU it reads LOCAL_RANK, which replica processes
# get (without it every replica had -1: no local main process, accelerator.print silent).
def test_accelerate_sees_a_local_main_process():
    pytest.importorskip("accelerate")  # in the dev environment (requirements-dev.txt)
    n = 2
    outcome = run(LOCAL_MAIN, n, timeout=120)
    results = _ok(outcome, n)
    assert results == {o: (o, o == 0) for o in range(n)}
    assert "printed by the local main process" in outcome.replicas[0].text


# 8. torch_xla.compile(full_graph=True) around xm.optimizer_step ---------------------------

COMPILED_STEP = '''
    import torch, torch.nn as nn
    import torch_xla, torch_xla.core.xla_model as xm

    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(device)
    initial = {k: v.detach().cpu().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(index)          # different data on every replica

    @torch_xla.compile(full_graph=True)
    def step(x, y):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        xm.optimizer_step(optimizer)
        return loss

    losses = []
    for _ in range(5):
        x = torch.randn(8, 4, generator=g)
        losses.append(step(x.to(device), x.sum(1, keepdim=True).to(device)).item())
    {"initial": initial, "losses": losses,
     "weights": {k: v.detach().cpu() for k, v in model.named_parameters()}}
    '''


@pytest.mark.stacks("kaggle")
def test_compile_full_graph_around_optimizer_step():
    n = 4
    results = _ok(run(COMPILED_STEP, n, timeout=120), n)
    _assert_same_weights(results, "weights")
    _assert_changed(results[0]["initial"], results[0]["weights"])
    for o, value in results.items():
        assert value["losses"][-1] < value["losses"][0], (o, value["losses"])


# 9. a seed in the cell: each replica its own generator -----------------------------------

SEEDS = '''
    import torch, torch.nn as nn
    torch.manual_seed(0)
    same = torch.rand(3)
    model = nn.Linear(3, 2).to(device)        # built after the same seed: the same start
    torch.manual_seed(index)
    different = torch.rand(3)
    {"same": same, "different": different, "weight": model.weight.detach().cpu()}
    '''


@pytest.mark.stacks("kaggle")
def test_seeding_in_the_cell_is_per_replica():
    import torch

    n = 4
    results = _ok(run(SEEDS, n, timeout=120), n)
    for o, value in results.items():
        assert torch.equal(value["same"], results[0]["same"]), o
        assert torch.equal(value["weight"], results[0]["weight"]), o
        assert torch.equal(value["different"],
                           torch.rand(3, generator=torch.Generator().manual_seed(o))), o
    differents = [tuple(results[o]["different"].tolist()) for o in range(n)]
    assert len(set(differents)) == n, differents
