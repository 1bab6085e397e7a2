"""Shared-memory tensors (colab_xla.wire.shared_tensors), units that need torch (but no XLA
runtime, no replicas): a missing torch skips this module."""

import errno
import os
import pickle

import pytest

from colab_xla.wire import shared_tensors, values

torch = pytest.importorskip("torch")


pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


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


# --- pages of freed results reused ------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run directory as the notebook makes it, in a root of its own."""
    monkeypatch.setattr(shared_tensors, "POOL_FRACTION", 1 / 8)
    path = shared_tensors.make_dir("run", root=str(tmp_path))
    yield path
    shared_tensors.remove_dir(os.path.dirname(path))  # the notebook process's own, in tmp_path


def _root(run_dir):
    """The shared-memory root a run directory was made in (its parent is the notebook
    process's own directory there)."""
    return os.path.dirname(os.path.dirname(run_dir))


def _listing(path):
    return sorted(name.split("-")[0] for name in os.listdir(path))


def _returned(tensor, run_dir):
    rebuild, args = shared_tensors.reduce_tensor(tensor, run_dir)
    return rebuild(*args)


def test_a_freed_results_pages_are_written_by_the_next_result_of_that_size(run_dir):
    pages = shared_tensors.pages_dir(run_dir)
    back = _returned(torch.ones(1 << 20), run_dir)
    assert _listing(pages) == ["held"] and not os.listdir(run_dir)  # mapped: held
    inode = os.stat(os.path.join(pages, os.listdir(pages)[0])).st_ino
    del back
    assert _listing(pages) == ["free"]
    rebuild, args = shared_tensors.reduce_tensor(torch.full((1 << 20,), 2.0), run_dir)
    assert os.listdir(pages) == [] and os.stat(args[0]).st_ino == inode  # the same file
    again = rebuild(*args)
    assert torch.equal(again, torch.full((1 << 20,), 2.0))


def test_free_pages_up_to_twice_the_size_are_used_and_cut_to_it(run_dir):
    pages = shared_tensors.pages_dir(run_dir)
    del_me = [_returned(torch.ones(3 << 20), run_dir), _returned(torch.ones(1 << 20), run_dir)]
    del del_me  # free: 12 MiB and 4 MiB
    assert _listing(pages) == ["free", "free"]
    small = _returned(torch.arange(1 << 18, dtype=torch.float32), run_dir)  # 1 MiB: none fits
    assert _listing(pages) == ["free", "free", "held"]
    middle = _returned(torch.arange(3 << 18, dtype=torch.float32), run_dir)  # 3 MiB: the 4 MiB
    sizes = sorted(os.stat(os.path.join(pages, n)).st_size for n in os.listdir(pages))
    assert sizes == [1 << 20, 3 << 20, 12 << 20] and _listing(pages) == ["free", "held", "held"]
    assert torch.equal(middle, torch.arange(3 << 18, dtype=torch.float32))
    assert torch.equal(small, torch.arange(1 << 18, dtype=torch.float32))


def test_free_pages_can_be_given_back(run_dir):
    back = [_returned(torch.ones(1 << 20), run_dir), _returned(torch.ones(1 << 20), run_dir)]
    kept = back[0]
    del back
    assert shared_tensors.drop_free_pages(_root(run_dir)) == 4 << 20
    assert _listing(shared_tensors.pages_dir(run_dir)) == ["held"] and float(kept[0]) == 1


def test_pages_beyond_the_limit_are_removed(run_dir, monkeypatch):
    monkeypatch.setattr(shared_tensors, "POOL_FRACTION", 0)
    back = _returned(torch.ones(1 << 20), run_dir)
    del back
    assert os.listdir(shared_tensors.pages_dir(run_dir)) == []


def test_pages_a_child_forked_since_may_see_are_removed_not_reused(run_dir):
    back = _returned(torch.ones(1 << 20), run_dir)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child maps the tensor too; it waits until the parent says go
        os.close(write_fd)
        os.read(read_fd, 1)
        os._exit(0)
    try:
        os.close(read_fd)
        del back
        assert os.listdir(shared_tensors.pages_dir(run_dir)) == []
    finally:
        os.close(write_fd)
        os.waitpid(pid, 0)


def test_a_forked_child_letting_go_of_its_copy_frees_nothing(run_dir):
    pages = shared_tensors.pages_dir(run_dir)
    back = _returned(torch.ones(1 << 20), run_dir)
    pid = os.fork()
    if pid == 0:
        del back  # runs the finalizer in the child: it must not free the notebook's pages
        os._exit(0 if _listing(pages) == ["held"] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _listing(pages) == ["held"] and float(back.sum()) == 1 << 20
    del back
    assert _listing(pages) == ["free"]  # the child has ended: kept


def test_the_page_directory_goes_when_the_notebook_process_exits(tmp_path):
    import subprocess
    import sys

    code = ("import sys, torch; from colab_xla.wire import shared_tensors as s\n"
            "d = s.make_dir('r', root=sys.argv[1])\n"
            "r, a = s.reduce_tensor(torch.ones(1 << 20), d); t = r(*a)\n"
            "print(len(__import__('os').listdir(s.pages_dir(d))))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.strip() == "1"  # held while it lived
    assert os.listdir(tmp_path) == []  # its own directory, pages and all, gone at exit


# --- a session replica's kept mappings ---------------------------------------------------------


@pytest.fixture
def keeping(monkeypatch):
    """This process as a session's replica: it keeps mappings of what it writes."""
    monkeypatch.setattr(shared_tensors, "_kept", {})
    monkeypatch.setattr(shared_tensors, "_to_map", [])
    monkeypatch.setattr(shared_tensors, "_keeping", None)  # restored so when the test ends
    shared_tensors.keep_mappings()
    yield
    for kept in shared_tensors._kept.values():
        kept.memory.close()
        os.close(kept.fd)


def _kept_bytes():
    """How many bytes of files this process keeps mapped."""
    return sum(len(kept.memory) for kept in shared_tensors._kept.values())


def _no_pwrite(monkeypatch):
    def refused(*args):
        raise AssertionError("pwrite called: the kept mapping was not used")

    monkeypatch.setattr(shared_tensors.os, "pwrite", refused)


def test_a_replica_that_keeps_mappings_writes_its_freed_pages_again_by_a_copy(
        run_dir, keeping, monkeypatch):
    pages = shared_tensors.pages_dir(run_dir)
    rebuild, args = shared_tensors.reduce_tensor(torch.ones(1 << 20), run_dir)  # pwrite
    assert _kept_bytes() == 0  # mapped only once the cell has ended
    shared_tensors.map_written()
    assert _kept_bytes() == 4 << 20
    back = rebuild(*args)  # the notebook maps it, then frees it
    del back
    assert _listing(pages) == ["free"]
    _no_pwrite(monkeypatch)
    again = _returned(torch.arange(1 << 20, dtype=torch.float32), run_dir)
    assert torch.equal(again, torch.arange(1 << 20, dtype=torch.float32))
    shared_tensors.map_written()  # known already: still one mapping
    assert _kept_bytes() == 4 << 20


def test_free_pages_kept_mapped_are_claimed_before_smaller_ones(run_dir, keeping):
    pages = shared_tensors.pages_dir(run_dir)
    rebuild, args = shared_tensors.reduce_tensor(torch.ones(1 << 20), run_dir)  # 4 MiB
    shared_tensors.map_written()
    inode = os.stat(args[0]).st_ino
    freed = [rebuild(*args), _returned(torch.ones(3 << 18), run_dir)]  # 4 MiB kept, 3 MiB not
    del freed
    assert _listing(pages) == ["free", "free"]
    rebuild, args = shared_tensors.reduce_tensor(torch.ones(1 << 19), run_dir)  # 2 MiB
    assert os.stat(args[0]).st_ino == inode  # the kept file, though the other one fits too
    assert torch.equal(rebuild(*args), torch.ones(1 << 19))


def test_kept_mappings_of_files_the_notebook_removed_are_let_go(run_dir, keeping):
    rebuild, args = shared_tensors.reduce_tensor(torch.ones(1 << 20), run_dir)
    shared_tensors.map_written()
    back = rebuild(*args)
    del back
    shared_tensors.let_go_removed()
    assert _kept_bytes() == 4 << 20  # free in the pool: kept
    assert shared_tensors.drop_free_pages(_root(run_dir)) == 4 << 20
    shared_tensors.let_go_removed()
    assert _kept_bytes() == 0 and shared_tensors._kept == {}


def test_a_cell_end_lets_go_of_removed_files_before_it_maps_what_the_cell_wrote(
        run_dir, keeping, monkeypatch):
    rebuild, args = shared_tensors.reduce_tensor(torch.ones(1 << 20), run_dir)
    shared_tensors.map_written()
    back = rebuild(*args)
    del back
    assert shared_tensors.drop_free_pages(_root(run_dir)) == 4 << 20  # removed
    shared_tensors.reduce_tensor(torch.ones(1 << 20), run_dir)  # the next cell's: a new file
    kept_when_mapping = []
    real_mmap = shared_tensors.mmap.mmap

    def mapping(*a, **k):
        kept_when_mapping.append(_kept_bytes())
        return real_mmap(*a, **k)

    monkeypatch.setattr(shared_tensors.mmap, "mmap", mapping)
    shared_tensors.map_written()
    assert kept_when_mapping == [0]  # the removed file's mapping went first
    assert _kept_bytes() == 4 << 20


def test_a_session_replica_waiting_for_its_next_cell_lets_go_each_check_period(monkeypatch):
    import collections
    import select

    from colab_xla.replica import serve

    waits, real_select = [], select.select

    def recorded(rlist, wlist, xlist, timeout=None):
        waits.append(timeout)
        return real_select(rlist, wlist, xlist, timeout)

    commands = object.__new__(serve._Commands)  # (without its urgent pipe's thread)
    read_fd, write_fd = os.pipe()
    commands._fd, commands._buffered, commands._lines = read_fd, b"", collections.deque()
    checks = []

    def let_go_removed():
        checks.append(1)
        if len(checks) == 3:  # the next command comes after the third check
            os.write(write_fd, b"debug answers output\n")

    monkeypatch.setattr(select, "select", recorded)
    monkeypatch.setattr(shared_tensors, "let_go_removed", let_go_removed)
    monkeypatch.setattr(shared_tensors, "KEPT_CHECK_SECONDS", 0.01)
    try:
        assert commands.next() == serve.DebugRequest("answers", "output")
        assert len(checks) == 3
        assert waits == [0.01] * 4  # each wait as long as the check period, and no longer
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_file_removed_before_the_cell_ended_is_not_mapped(run_dir, keeping):
    rebuild, args = shared_tensors.reduce_tensor(torch.ones(1 << 20), run_dir)
    os.unlink(args[0])  # a run cut short: the notebook removed its directory
    shared_tensors.map_written()
    assert _kept_bytes() == 0 and shared_tensors._to_map == []


def test_a_replica_that_does_not_keep_mappings_maps_nothing(run_dir):
    rebuild, args = shared_tensors.reduce_tensor(torch.ones(1 << 20), run_dir)
    shared_tensors.map_written()
    assert _kept_bytes() == 0 and shared_tensors._to_map == []
    assert torch.equal(rebuild(*args), torch.ones(1 << 20))


def test_a_child_forked_from_a_keeping_replica_has_no_mapping_and_writes_by_pwrite(
        run_dir, keeping):
    rebuild, args = shared_tensors.reduce_tensor(torch.ones(1 << 20), run_dir)
    shared_tensors.map_written()
    inode = str(os.stat(args[0]).st_ino)
    back = rebuild(*args)
    del back  # free: the child below claims it
    src = torch.full((1 << 20,), 3.0)  # made here: the child runs no torch op after fork
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say
        code = 1
        try:
            with open("/proc/self/maps") as f:
                mapped = any(line.split()[4] == inode for line in f)
            _, child_args = shared_tensors.reduce_tensor(src, run_dir)
            os.write(write_fd, pickle.dumps(child_args))
            code = 2 if mapped else 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # 2: it mapped the file; < 0: it crashed
    child_args = pickle.loads(data)
    assert str(os.stat(child_args[0]).st_ino) == inode  # the same pages, written by pwrite
    assert torch.equal(shared_tensors.rebuild(*child_args), src)
