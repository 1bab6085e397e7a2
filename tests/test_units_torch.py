"""Units of the IPython-free core that need torch (but no XLA runtime, no replicas):
shared-memory tensors. Kept apart from test_units.py so a missing torch skips only these."""

import errno
import os
import pickle

import pytest

from colab_xla.transport import shared_tensors, values

torch = pytest.importorskip("torch")


def test_pack_value_keeps_nested_cpu_tensors():
    value = {"w": [torch.arange(3.0)], "n": 2}
    back = pickle.loads(values.pack_value(value))
    assert back["n"] == 2 and torch.equal(back["w"][0], torch.arange(3.0))


@pytest.fixture
def shm_dir(tmp_path):
    return str(tmp_path)  # any directory works; /dev/shm makes it memory


@pytest.mark.parametrize("make", [
    lambda: torch.arange(1 << 19, dtype=torch.float32).reshape(512, 1024),
    lambda: torch.ones(1 << 20, dtype=torch.bfloat16),
    lambda: torch.arange(1 << 21) % 2 == 0,                                    # bool
    lambda: torch.arange(1 << 18, dtype=torch.int64).reshape(512, 512).t(),    # not contiguous
])
def test_large_tensors_round_trip_through_files(shm_dir, make):
    tensor = make()
    rebuild, args = shared_tensors.reduce_tensor(tensor, shm_dir)
    assert os.listdir(shm_dir)  # written...
    back = rebuild(*args)
    assert not os.listdir(shm_dir)  # ...and the file removed once mapped
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)


@pytest.mark.parametrize("make", [
    lambda: torch.ones(10),                                     # small: inline
    lambda: torch.ones(1 << 20, requires_grad=True),            # needs autograd: inline
    lambda: torch.nn.Parameter(torch.ones(1 << 20)),            # a subclass: inline
])
def test_other_tensors_are_left_to_pickle(shm_dir, make):
    assert shared_tensors.reduce_tensor(make(), shm_dir) is None
    assert shared_tensors.reduce_tensor(torch.ones(1 << 20), None) is None
    assert not os.listdir(shm_dir)


def test_a_full_shared_memory_falls_back_to_inline_and_leaves_no_file(shm_dir, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_tensors.os, "pwrite", full)
    assert shared_tensors.reduce_tensor(torch.ones(1 << 20), shm_dir) is None
    assert not os.listdir(shm_dir)


def test_pickled_values_use_shared_memory_for_big_tensors_inside_containers(shm_dir):
    value = {"w": torch.ones(1 << 20), "small": torch.zeros(3), "n": 1}
    data = values.pack_value(value, shm_dir)
    assert len(data) < 10_000 and len(os.listdir(shm_dir)) == 1
    back = pickle.loads(data)
    assert torch.equal(back["w"], value["w"]) and torch.equal(back["small"], value["small"])
    assert len(values.pack_value(value)) > 4 << 20  # without a directory: inline
