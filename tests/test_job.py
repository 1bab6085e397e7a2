"""A replica's job (colab_xla.wire.job): how it travels to a replica and what it sets there."""

import dataclasses
import os
import pickle
import sys

import pytest

from colab_xla.wire.cell import Cell, CellModule
from colab_xla.wire.job import ReplicaJob

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_a_sessions_job_goes_pickled_in_the_line_or_through_a_file_and_arrives_the_same(
        tmp_path, monkeypatch):
    """job_to_command: a job (with a Manager lock's proxy too, here an object that only
    pickles) pickled in the line as ``job``, a job too large for a line as ``run`` and a
    file. job_from_command gives back the same job each way, and a replica that runs another
    Python compiles the cell's marshalled code again from its file."""
    import types

    from colab_xla.wire import job as wire_job
    from colab_xla.wire.job import JOB_VERBS, ReplicaJob, job_from_command, job_to_command

    arrived = []
    monkeypatch.setattr(wire_job, "arrived", lambda j: arrived.append(j) or j)
    cell = CellModule.create(Cell("x = 6\nx * 7\n", label="Cell In[4]"), str(tmp_path))
    job = ReplicaJob(run_id="ab12", run_dir=str(tmp_path), channel_path="channel",
                     parent_pid=7, fd_paths=(("o", "e"),), environ={"A": "1"}, cell=cell,
                     names=b"\x00names", pull=("w",), pull_from=1, chosen=(0, 2))

    def through(command: str):
        verb, _, arg = command.partition(" ")
        assert verb in JOB_VERBS
        return verb, job_from_command(verb, arg)

    def same(got, sent) -> None:
        assert {k: v for k, v in got.__dict__.items() if k != "cell"} == {
            k: v for k, v in sent.__dict__.items() if k != "cell"}
        assert (got.cell.name, got.cell.path, got.cell.label, got.cell.source) == (
            cell.name, cell.path, "Cell In[4]", cell.source)
        ns = {}
        exec(got.cell.body, ns)
        assert eval(got.cell.last_expr, ns) == 42

    verb, got = through(job_to_command(job, str(tmp_path)))
    assert verb == "job" and arrived == [got]  # (set up where it is unpickled: arrived)
    same(got, job)
    locked = dataclasses.replace(job, lock=types.SimpleNamespace(held=False))
    verb, got = through(job_to_command(locked, str(tmp_path)))
    assert verb == "job" and got.lock == locked.lock
    same(got, locked)
    large = dataclasses.replace(job, names=b"n" * 4096)
    verb, got = through(job_to_command(large, str(tmp_path)))
    assert verb == "run" and os.path.exists(os.path.join(str(tmp_path), "job.pickle"))
    same(got, large)
    command = job_to_command(job, str(tmp_path))
    with open(cell.path, "w") as f:  # read by another Python: the file's code, compiled
        f.write("# %%xla_spawn\nx = 5\nx * 7\n")
    monkeypatch.setattr("importlib.util.MAGIC_NUMBER", b"\x00\x00\r\n")
    _, other = through(command)
    ns = {}
    exec(other.cell.body, ns)
    assert eval(other.cell.last_expr, ns) == 35


def test_a_replica_job_sets_its_environment_where_it_is_unpickled(tmp_path):
    job = ReplicaJob(run_id="r", run_dir=str(tmp_path), channel_path="c", parent_pid=1,
                             environ={"PATH": os.environ["PATH"], "ONLY_IN_JOB": "yes"})
    (tmp_path / "job.pkl").write_bytes(pickle.dumps(job))
    script = ("import os, pickle, sys; os.environ['DROPPED'] = '1'; "
              f"job = pickle.load(open({str(tmp_path / 'job.pkl')!r}, 'rb')); "
              "print(os.environ.get('ONLY_IN_JOB'), os.environ.get('DROPPED'), job.run_id)")
    import subprocess
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["yes", "None", "r"], done.stderr
