"""colab_xla.runtimes.shm_collectives in real processes: forked processes of one machine meet
through a FileStore, as the CPU simulation's replica processes do, and reduce and gather
through shared memory; what they get is checked against the same operation done in one
process, for every reduction, dtype and size (a chunk, several, part of one, nothing)."""

import contextlib
import functools
import io
import multiprocessing
import os
import resource
import signal
import time
import traceback

import pytest
import torch

from colab_xla.runtimes import gloo_collectives, shm_collectives
from colab_xla.wire import shared_tensors


pytestmark = [pytest.mark.stacks("colab", "kaggle")]

CHUNK = 4096  # bytes: small, so a few thousand elements take several chunks and both halves


def _input(rank, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-50, 50, (numel,), generator=g).to(dtype)


def _expected(op, inputs):
    """The reduction in one process, folded in rank order (as the group promises: the
    same bits as a sum in that order, not just a close one; but see _summed)."""
    fold = {"sum": torch.add, "mul": torch.mul, "min": torch.minimum, "max": torch.maximum,
            "and": torch.bitwise_and, "or": torch.bitwise_or}[op]
    return functools.reduce(fold, inputs)


def _summed(op, dtype, shapes):
    """Whether the group sums these (one call's tensors) in one pass over the slots
    (``torch.sum``), whose association is torch's own: a float32 or float64 sum through a
    result file (a chunk or more in all). Those are close to the fold in rank order; every
    replica's has the same bits."""
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    return (op == "sum" and dtype in (torch.float32, torch.float64)
            and numel * dtype.itemsize >= CHUNK)


def _replica(rank, world, store_path, root, work, results):
    try:
        group = shm_collectives.ShmGroup(gloo_collectives.file_store(store_path, world),
                                         rank, world, root=root, chunk_bytes=CHUNK)
        out = []
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            _work(rank, group, root, work, out, stderr)
        group.close()
        buffer = io.BytesIO()  # bytes: a tensor put as is would be shared by an fd
        torch.save(out, buffer)
        results.put((rank, buffer.getvalue()))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _work(rank, group, root, work, out, stderr):
    for kind, args in work:
        if kind == "reduce":
            op, shapes, dtype, seed = args
            tensors = [_input(rank, int(torch.Size(s).numel()), dtype, seed + i).view(s)
                       for i, s in enumerate(shapes)]
            out.append([t.clone() for t in group.all_reduce(op, tensors)])
        elif kind == "reduce_scaled":  # a list of mixed dtypes, as optimizer_step's
            shapes_and_dtypes, scale, seed = args
            tensors = [_input(rank, int(torch.Size(s).numel()), dtype, seed + i).view(s)
                       for i, (s, dtype) in enumerate(shapes_and_dtypes)]
            out.append([t.clone() for t in group.all_reduce("sum", tensors, scale=scale)])
        elif kind == "reduce_and_write":  # a result written in place, then the next
            first = group.all_reduce("sum", [_input(rank, args, torch.float32, 0)])[0]
            first += rank  # (after every replica has its result: the next call's barriers)
            again = group.all_reduce("sum", [_input(rank, args, torch.float32, 0)])[0]
            group._whole(None).barrier()
            out.append([first.clone(), again.clone()])
        elif kind == "pool":  # results held past the pool's size, then let go
            held = [group.all_reduce("sum", [_input(rank, CHUNK, torch.float32, seed)])[0]
                    for seed in range(shm_collectives.POOL_FILES + 1)]
            pool = group._whole(None).pool
            made = [pool.made]
            out.append([t.clone() for t in held])  # (after every call: none overwritten)
            del held
            again = group.all_reduce("sum", [_input(rank, CHUNK, torch.float32, 9)])[0]
            made.append(pool.made)
            other = group.all_reduce("sum", [_input(rank, 2 * CHUNK, torch.float32, 10)])[0]
            made.append(pool.made)
            out.append([again.clone(), other.clone(), torch.tensor(made)])
        elif kind == "reduce_without_room":  # no room for the result file on replica 0
            numel, seed = args
            group._whole(None)  # (the group's slots made first, with room)
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            if rank == 0:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (numel * 4 - 1, limit[1]))
            try:
                result = group.all_reduce("sum", [_input(rank, numel, torch.float32, seed)])
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            out.append([t.clone() for t in result])
        elif kind == "gather":
            numel, dtype, seed = args
            out.append([t.clone() for t in group.all_gather(_input(rank, numel, dtype,
                                                                    seed))])
        elif kind == "files":  # what is left of the group on disk, once it is made
            out.append(sorted(os.path.relpath(os.path.join(d, name), root)
                              for d, dirs, files in os.walk(root) for name in dirs + files))
            if group._shared is not None:  # (every replica looked before any closes it)
                group._shared.barrier()
        elif kind == "sleep_in_barrier":
            if rank == 1:
                time.sleep(60)  # never arrives: the others wait in the barrier
            group._whole(None).barrier()
        elif kind == "file_size_limit" and rank == args:
            # A real refusal by the kernel, as a full /dev/shm's ENOSPC: EFBIG (and
            # SIGXFSZ, ignored) for a file as large as a slot, while the group is made.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (2 * CHUNK - 1, limit[1]))
            try:
                group._whole(None)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        elif kind == "stderr":
            out.append(stderr.getvalue())


def _run(world, work, root, tmp_path):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_replica, args=(r, world, store, root, work, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank, out in got.items():
        assert not isinstance(out, str), f"replica {rank} failed:\n{out}"
    return [torch.load(io.BytesIO(got[r])) for r in range(world)]


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "shm"
    path.mkdir()
    return str(path)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_reduction_of_every_dtype_matches_one_process_on_every_replica(world, root,
                                                                              tmp_path):
    cases = [(op, dtype) for op in ("sum", "min", "max") for dtype in
             (torch.float32, torch.bfloat16, torch.int64, torch.float64)]
    cases += [("mul", torch.float64), ("and", torch.bool), ("or", torch.bool),
              ("and", torch.int32), ("or", torch.uint8)]
    # sizes: several chunks with a part of one (float32: 1024 a chunk), less than one
    # element a replica, a scalar, nothing; and a list of mixed shapes and dtypes
    # and a list whose tensors cross chunks, one of them empty
    sizes = [[(2600,)], [(5,)], [()], [(0,)], [(3, 7), (1000,), ()],
             [(700,), (0,), (900,), (5, 300)]]
    work = [("reduce", (op, shapes, dtype, seed))
            for seed, ((op, dtype), shapes) in enumerate(
                (case, shapes) for case in cases for shapes in sizes)]
    results = _run(world, work, root, tmp_path)
    summed = 0
    for i, (_, (op, shapes, dtype, seed)) in enumerate(work):
        for t, shape in enumerate(shapes):
            numel = int(torch.Size(shape).numel())
            want = _expected(op, [_input(r, numel, dtype, seed + t) for r in range(world)])
            for rank in range(world):
                got = results[rank][i][t]
                assert got.dtype == dtype and got.shape == torch.Size(shape)
                if _summed(op, dtype, shapes) and world > 1:
                    summed += 1
                    assert torch.allclose(got, want.view(shape), rtol=1e-6, atol=1e-6)
                else:
                    assert torch.equal(got, want.view(shape)), (op, dtype, shape, rank)
                # one reduction, copied: every replica has the same bits
                assert torch.equal(got, results[0][i][t])
    assert summed or world == 1  # (the one-pass sum was taken)


@pytest.mark.parametrize("world", [3])
def test_a_scaled_sum_is_the_sum_times_the_scale_and_leaves_integers_unscaled(world, root,
                                                                           tmp_path):
    f32, i64, f64 = torch.float32, torch.int64, torch.float64
    calls = [  # floats of a chunk or more in all (through a result file), parts crossing
        # chunks, an empty one, integers between them; then small (copied out of a slot)
        ([((1500,), f32), ((1200,), i64), ((0,), f32), ((2, 800), f32)], 0.25),
        ([((5,), f64), ((3,), i64), ((), f64)], 0.5)]
    work = [("reduce_scaled", (parts, scale, 10 * i)) for i, (parts, scale) in enumerate(calls)]
    results = _run(world, work, root, tmp_path)
    for i, (parts, scale) in enumerate(calls):
        for t, (shape, dtype) in enumerate(parts):
            numel = int(torch.Size(shape).numel())
            fold = _expected("sum", [_input(r, numel, dtype, 10 * i + t) for r in range(world)])
            want = (fold * scale if dtype.is_floating_point else fold).view(shape)
            for rank in range(world):
                got = results[rank][i][t]
                assert got.dtype == dtype and got.shape == torch.Size(shape)
                if i == 0 and dtype.is_floating_point:  # (torch.sum's association)
                    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
                else:
                    assert torch.equal(got, want), (i, t, rank)
                assert torch.equal(got, results[0][i][t])  # the same bits everywhere


@pytest.mark.parametrize("world", [2, 5])
def test_gather_returns_every_replicas_tensor_by_rank(world, root, tmp_path):
    work = [("gather", (numel, dtype, seed)) for seed, (numel, dtype) in enumerate(
        [(3000, torch.float32), (1, torch.int8), (0, torch.float32), (9000, torch.bool)])]
    results = _run(world, work, root, tmp_path)
    for i, (_, (numel, dtype, seed)) in enumerate(work):
        want = [_input(r, numel, dtype, seed) for r in range(world)]
        for rank in range(world):
            assert len(results[rank][i]) == world
            for r in range(world):
                assert torch.equal(results[rank][i][r], want[r])


def test_nothing_is_left_on_disk_but_the_groups_empty_directory_until_it_closes(root,
                                                                                tmp_path):
    # (a reduction copied out of a slot, then one through a result file: 3 chunks)
    work = [("reduce", ("sum", [(10,)], torch.float32, 0)),
            ("reduce", ("sum", [(3 * CHUNK // 4,)], torch.float32, 1)), ("files", None)]
    results = _run(4, work, root, tmp_path)
    left = results[0][2]
    assert len(left) == 1 and os.path.basename(left[0]).startswith(
        shared_tensors._PREFIX), left  # the group's directory, and nothing in it
    assert all(out[2] == left for out in results)
    assert os.listdir(root) == []  # (the group closed with its processes)


def test_a_result_file_without_room_is_not_made_and_every_replica_copies_its_result_out(
        root, tmp_path):
    work = [("reduce_without_room", (3 * CHUNK // 4, 5)), ("files", None)]
    results = _run(3, work, root, tmp_path)
    want = _expected("sum", [_input(r, 3 * CHUNK // 4, torch.float32, 5) for r in range(3)])
    for rank in range(3):
        assert torch.equal(results[rank][0][0], want)
        assert len(results[rank][1]) == 1  # the group's directory: no result file in it


def test_a_result_file_leaves_room_in_shared_memory_for_the_others(tmp_path, monkeypatch):
    """DataLoader workers' batches and the notebook's large results use /dev/shm too."""
    free = {"bytes": 0}
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result(
        (4096, 4096, 1 << 30, free["bytes"] // 4096, free["bytes"] // 4096, 0, 0, 0, 0, 255)))
    size = 16 << 20
    free["bytes"] = 2 * size + shm_collectives.ROOM_LEFT_BYTES
    assert shm_collectives.room_for_result(str(tmp_path), size)
    free["bytes"] -= 4096
    assert not shm_collectives.room_for_result(str(tmp_path), size)


def test_a_result_through_a_file_is_each_replicas_own_to_write(root, tmp_path):
    """Every replica maps the call's result file copy-on-write: XLA writing into its
    buffer (a donated one) writes into a page of its own, never another replica's."""
    work = [("reduce_and_write", CHUNK)]
    results = _run(3, work, root, tmp_path)
    want = _expected("sum", [_input(r, CHUNK, torch.float32, 0) for r in range(3)])
    for rank in range(3):
        mine, after = results[rank][0]
        assert torch.equal(mine, want + rank) and torch.equal(after, want), rank


def test_result_files_are_reused_once_no_replica_holds_a_result_from_them(root, tmp_path):
    """The group keeps POOL_FILES result files: a call takes one no replica holds a result
    from (held results keep their values), copies its result out when every file is held,
    reuses a file once its results are gone, and makes one of a new size in place of a free
    one."""
    files = shm_collectives.POOL_FILES
    results = _run(3, [("pool", None), ("files", None)], root, tmp_path)
    for rank in range(3):
        held, (again, other, _) = results[rank][0], results[rank][1]
        for seed, got in enumerate(held):
            assert torch.equal(got, _expected(
                "sum", [_input(r, CHUNK, torch.float32, seed) for r in range(3)])), seed
        assert torch.equal(again, _expected(
            "sum", [_input(r, CHUNK, torch.float32, 9) for r in range(3)]))
        assert torch.allclose(other, _expected(
            "sum", [_input(r, 2 * CHUNK, torch.float32, 10) for r in range(3)]))
        assert len(results[rank][2]) == 1  # no result file's name is left
    # (replica 0 makes them) one per held result but the last (copied out), none for the
    # call after they are let go, one for the new size
    assert results[0][1][2].tolist() == [files, files, files + 1]


def test_a_result_file_made_by_a_call_cut_short_is_not_reused_by_name(tmp_path):
    """Replica 0 made a file for a call that an interrupt cut short before every replica
    opened it: the next call does not choose it (its name goes, and a replica that never
    opened it could not), and the pool's marks follow a result's mapping (one process,
    replica 0 of 2)."""
    import mmap

    slots = mmap.mmap(-1, shm_collectives._table_bytes(2))
    pool = shm_collectives._Pool(slots, 0, 2, str(tmp_path))
    pool.choose(8192)  # (the call is cut short here)
    first = sorted(os.listdir(tmp_path))
    pool.choose(8192)
    assert first == ["result-0"] and sorted(os.listdir(tmp_path)) == ["result-1"]
    assert pool.made == 2
    file = pool.take()
    assert file.generation == 1  # (not the file of the call cut short, by its name)
    pool.unlink_new()  # (the call's last barrier)
    mine = pool.own(file, 8192)
    pool.choose(8192)  # its file is held by this replica: another place, a new file
    other = pool.take()
    assert other.index != file.index and pool.made == 3
    pool.free(other.index)  # (that call's result let go at once)
    pool.unlink_new()
    pool.choose(8192)
    assert pool._table[0].item() == other.index
    pool.free(other.index)
    del mine  # the result's mapping is gone: its file is free again, the first chosen
    pool.choose(8192)
    assert pool._table[0].item() == file.index and pool.made == 3
    pool.close()


def test_a_group_without_room_for_a_slot_goes_through_gloo_and_says_why(root, tmp_path):
    """A slot's pages are taken when the group is made: a /dev/shm without room for them
    refuses then (not as a SIGBUS when a collective first touches a page), and the whole
    group goes through gloo, with the same results; replica 0 says why, once."""
    # (int64: gloo's sum of floats is in an order of its own)
    work = [("file_size_limit", 2), ("reduce", ("sum", [(3000,)], torch.int64, 7)),
            ("gather", (100, torch.int32, 8)), ("files", None), ("stderr", None)]
    results = _run(3, work, root, tmp_path)
    want = _expected("sum", [_input(r, 3000, torch.int64, 7) for r in range(3)])
    for rank in range(3):
        assert torch.equal(results[rank][0][0], want)
        assert all(torch.equal(results[rank][1][r], _input(r, 100, torch.int32, 8))
                   for r in range(3))
        assert results[rank][2] == []  # nothing left of the group that was not made
    said = results[0][3]
    assert said.count("colab_xla: the collectives go through gloo") == 1, said
    assert "replica 2: File too large" in said and f"{root} has" in said, said
    assert "--shm-size" in said and results[1][3] == results[2][3] == ""
    assert os.listdir(root) == []


def test_a_group_of_some_replicas_goes_through_gloo(root, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gloo_collectives.GlooGroup, "all_reduce",
                        lambda self, op, tensors, members=None, scale=1.0:
                        calls.append(members) or
                        [t.clone() for t in tensors])
    group = shm_collectives.ShmGroup(None, 0, 4, root=root)
    group.all_reduce("sum", [torch.ones(3)], members=[0, 1])
    assert calls == [[0, 1]] and group._shared is None  # nothing shared was made
    assert group.position([2, 0]) == 1 and group.position(None) == 0


def test_a_replica_waiting_for_one_that_never_comes_is_interrupted_in_the_wait(root,
                                                                               tmp_path):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    store = str(tmp_path / "store")
    work = [("reduce", ("sum", [(4,)], torch.float32, 0)), ("sleep_in_barrier", None)]
    procs = [ctx.Process(target=_replica, args=(r, 2, store, root, work, results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        # replica 0 is in the barrier (a read of a FIFO) once replica 1 sleeps: wait for
        # that state, not for a time
        deadline = time.monotonic() + 30
        while _state(procs[0].pid) != "S" or "pipe" not in _wchan(procs[0].pid):
            assert time.monotonic() < deadline, "replica 0 never waited in the barrier"
            time.sleep(0.01)
        os.kill(procs[0].pid, signal.SIGINT)
        rank, out = results.get(timeout=10)
        assert rank == 0 and "KeyboardInterrupt" in out and "barrier" in out
    finally:
        for p in procs:
            p.kill()
            p.join()


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wchan(pid):
    """Where in the kernel ``pid`` sleeps: ``pipe_read``, ``anon_pipe_read`` (Linux 6.x) or
    ``pipe_wait`` in a read of a FIFO."""
    with open(f"/proc/{pid}/wchan") as f:
        return f.read()


def test_a_private_directory_of_a_process_that_is_gone_is_pruned(tmp_path):
    made = shared_tensors.make_private_dir("collectives", str(tmp_path))
    assert os.path.basename(made).startswith(f"colab_xla-{os.getuid()}-{os.getpid()}-")
    dead = tmp_path / os.path.basename(made).replace(f"-{os.getpid()}-", "-999999999-")
    os.rename(made, dead)
    shared_tensors.prune(str(tmp_path))
    assert not dead.exists()
