"""Who holds the TPU (issue #11, item 4): a fake /proc tree, real locks held by real child
processes, and the refusal before anything starts. No TPU, no replicas."""

import os
import subprocess
import sys

import psutil
import pytest

from colab_xla.notebook import doctor, hardware, preflight, torch_xla_import, tpu_holders
from colab_xla.notebook import targets
from colab_xla.notebook.targets import one_off
from colab_xla.notebook.tpu_holders import Holder, Scan
from colab_xla.wire.cell import Cell

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]

# --- a fake /proc ----------------------------------------------------------------------------


def fake_process(root, pid, cmdline, uid, files=()):
    """``root/<pid>`` with cmdline, status and ``fd/<n>`` links to ``files``."""
    base = root / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "cmdline").write_bytes(b"\0".join(a.encode() for a in cmdline) + b"\0")
    (base / "status").write_text(f"Name:\t{cmdline[0]}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    for n, target in enumerate(files):
        os.symlink(target, base / "fd" / str(n))


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    fake_process(root, 100, ["python3", "train.py", "--steps", "9"], 0,
                 ["/dev/null", "/dev/accel0", "/dev/accel1", "socket:[1234]"])
    fake_process(root, 200, ["/usr/bin/python3", "-m", "ipykernel_launcher"], 0,
                 ["/dev/vfio/vfio", "/dev/vfio/0"])
    fake_process(root, 300, ["bash"], 0, ["/dev/pts/0", "/dev/vfio/vfio"])  # no chip
    fake_process(root, 400, ["secret-daemon"], 12345, ["/dev/accel2"])
    (root / "500").mkdir()  # ended between listing /proc and reading it: no fd dir
    (root / "self").mkdir()  # not a pid
    return root


def no_lockfile(tmp_path):
    return dict(lockfile=str(tmp_path / "absent_lockfile"), proc_locks=str(tmp_path / "no_locks"))


@pytest.fixture
def unreadable_400(monkeypatch, proc):
    """pid 400 is another user's: its fd directory cannot be listed (as for a non-root user)."""
    listdir = os.listdir

    def guarded(path):
        if str(path) == f"{proc}/400/fd":
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", guarded)


def test_processes_with_a_tpu_device_open_are_found_with_cmdline_and_user(proc, tmp_path):
    found = tpu_holders.scan(str(proc), lockfile=str(tmp_path / "absent"), own_pid=1)
    assert [(h.pid, h.devices, h.user) for h in found.holders] == [
        (100, ("/dev/accel0", "/dev/accel1"), "root"),
        (200, ("/dev/vfio/0",), "root"),  # the VFIO group, not the /dev/vfio/vfio container
        (400, ("/dev/accel2",), "uid 12345")]
    assert found.holders[0].cmdline == "python3 train.py --steps 9"
    assert found.unreadable == 0 and found.lockfile_state == "absent"
    assert not (tmp_path / "absent").exists()  # looking never creates the lock file


def test_unreadable_processes_are_counted_not_guessed_at(proc, tmp_path, unreadable_400):
    found = tpu_holders.scan(str(proc), **no_lockfile(tmp_path), own_pid=1)
    assert [h.pid for h in found.holders] == [100, 200] and found.unreadable == 1
    assert tpu_holders.fact(found).endswith(
        "pid 200 (has /dev/vfio/0 open) (1 process of other users could not be checked)")


def test_the_message_names_pid_cmdline_user_and_the_fix(proc, tmp_path):
    found = tpu_holders.scan(str(proc), dev_globs=("/dev/accel[0-9]*",), **no_lockfile(tmp_path),
                             own_pid=1)
    [problem] = tpu_holders.problems(found, modules={})
    assert problem.code == "tpu-held" and problem.fatal
    assert problem.message.startswith("The TPU is in use, so every replica would fail")
    assert "pid 100 (`python3 train.py --steps 9`, user root) has /dev/accel0, /dev/accel1 open" \
        in problem.message
    assert "For pid 100: stop it where it runs, or `!kill 100`" in problem.fix
    assert "For pid 400:" in problem.fix and "kill 400" in problem.fix
    assert tpu_holders.fact(found).startswith("pid 100 (has /dev/accel0, /dev/accel1 open)")


def test_a_colab_xla_leftover_is_fixed_with_kill_leftovers(proc, tmp_path):
    found = tpu_holders.scan(str(proc), **no_lockfile(tmp_path), own_pid=1)
    [problem] = tpu_holders.problems(found, leftover_pids={200}, modules={})
    assert "a process left by an earlier colab_xla run" in problem.message
    assert "For pid 200: run %xla_doctor --kill-leftovers" in problem.fix
    assert "For pid 100: stop it" in problem.fix  # the others keep their own fix


@pytest.mark.parametrize("modules, said", [({"jax": sys, "jaxlib": sys}, "jax, jaxlib"),
                                           ({"tensorflow": sys}, "tensorflow"),
                                           ({}, "neither")])
def test_the_notebooks_own_process_is_named_with_what_it_imported(proc, tmp_path, modules, said):
    found = tpu_holders.scan(str(proc), **no_lockfile(tmp_path), own_pid=200)
    assert [h.own for h in found.holders] == [False, True, False]
    [problem] = tpu_holders.problems(found, modules=modules)
    assert (f"this notebook's own process (pid 200; JAX/TensorFlow imported: {said}) "
            "has /dev/vfio/0 open") in problem.message
    assert "For this notebook: restart the runtime" in problem.fix
    assert "JAX_PLATFORMS" in problem.fix
    assert "this notebook (has /dev/vfio/0 open)" in tpu_holders.fact(found)


def test_nobody_is_said_when_nothing_holds_the_tpu(tmp_path):
    empty = tmp_path / "proc"
    fake_process(empty, 7, ["bash"], 0, ["/dev/null"])
    found = tpu_holders.scan(str(empty), **no_lockfile(tmp_path), own_pid=7)
    assert found.holders == () and tpu_holders.fact(found) == "nobody"
    assert tpu_holders.problems(found) == []


# --- the libtpu lock file, held by real processes ------------------------------------------

_HOLD = """
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.lockf(fd, os.F_TLOCK, 0)  # what libtpu does (a POSIX record lock)
os.write(1, b"L")
sys.stdin.read()  # hold until the test says or kills us
"""


@pytest.fixture
def holder(tmp_path):
    """A child process that locks ``tmp_path/libtpu_lockfile``, known to hold it once it
    has written one byte on its stdout pipe. Killed (by pid) at the end."""
    lockfile = tmp_path / "libtpu_lockfile"
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(lockfile), "lock-holder-marker"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.read(1) == b"L"
        yield child, str(lockfile)
    finally:
        child.kill()
        child.wait()


def locked_by(lockfile):
    """Pids /proc/locks names for the file (an independent reading): its lines with the
    file's inode number whose process has the file open, each process once. (The number
    alone is not enough: another filesystem's file may have it, and a process that locks
    that one, as sqlite does, once named this test's process twice.)"""
    ino, real = os.stat(lockfile).st_ino, os.path.realpath(lockfile)

    def has_open(pid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return False
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == real:
                    return True
            except OSError:
                continue
        return False

    pids = {int(line.split()[4]) for line in open("/proc/locks")
            if line.split()[1] != "->" and int(line.split()[5].rsplit(":", 1)[1]) == ino}
    return sorted(pid for pid in pids if has_open(pid))


def scan_real(tmp_path, lockfile, **kw):
    return tpu_holders.scan("/proc", dev_globs=(str(tmp_path / "accel[0-9]*"),),
                            lockfile=lockfile, **kw)


def test_the_process_that_locks_the_lock_file_is_named(holder, tmp_path):
    child, lockfile = holder
    found = scan_real(tmp_path, lockfile)
    assert found.lockfile_state == "held"
    [h] = found.holders
    assert (h.pid, h.locks_lockfile, h.own, h.devices) == (child.pid, True, False, ())
    assert "lock-holder-marker" in h.cmdline
    [problem] = tpu_holders.problems(found, modules={})
    assert f"pid {child.pid} (`{sys.executable} -c" in problem.message
    assert "locks the libtpu lock file" in problem.message and f"kill {child.pid}" in problem.fix


def test_without_proc_locks_the_file_is_probed_and_the_probe_takes_no_lock(holder, tmp_path):
    child, lockfile = holder
    found = scan_real(tmp_path, lockfile, proc_locks=str(tmp_path / "no_proc_locks"))
    assert [(h.pid, h.locks_lockfile) for h in found.holders] == [(child.pid, True)]
    assert locked_by(lockfile) == [child.pid]  # still the child's, and only the child's


def test_a_lock_line_on_another_device_counts_only_if_its_process_has_the_file_open(
        holder, tmp_path):
    child, lockfile = holder  # e.g. /tmp on overlayfs: /proc/locks names the upper device
    st = os.stat(lockfile)
    here = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    me = os.getpid()
    locks = tmp_path / "locks"
    locks.write_text(f"1: POSIX  ADVISORY  WRITE {child.pid} ff:7f:{st.st_ino} 0 EOF\n"
                     f"2: POSIX  ADVISORY  WRITE {me} ff:7f:{st.st_ino} 0 EOF\n"
                     f"3: -> POSIX  ADVISORY  WRITE {me} {here} 0 EOF\n"  # a waiter
                     f"4: FLOCK  ADVISORY  WRITE {me} {here[:-1]}x 0 EOF\n")  # not a number
    found = scan_real(tmp_path, lockfile, proc_locks=str(locks), own_pid=1)
    assert [h.pid for h in found.holders] == [child.pid]  # this test process has it not open


def test_a_lock_file_whose_holder_is_gone_is_stale_with_the_command_to_remove_it(holder, tmp_path):
    child, lockfile = holder
    child.kill()  # SIGKILL: libtpu's atexit never removes the file
    child.wait()
    assert os.path.exists(lockfile) and locked_by(lockfile) == []
    for proc_locks in (None, str(tmp_path / "no_proc_locks")):  # read, and probed
        found = scan_real(tmp_path, lockfile, proc_locks=proc_locks)
        assert found.lockfile_state == "stale" and found.holders == ()
        [problem] = tpu_holders.problems(found)
        assert problem.code == "tpu-stale-lock" and not problem.fatal  # this user can open it
        assert problem.fix.endswith(f"!rm {lockfile}")
        assert tpu_holders.fact(found) == f"nobody, but {lockfile} is left over"


def test_a_lock_file_this_user_cannot_open_is_refused(holder, tmp_path, monkeypatch):
    child, lockfile = holder
    child.kill()
    child.wait()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if p == lockfile else real_access(p, m))
    monkeypatch.setattr(tpu_holders, "_user", lambda uid: "alice")
    [problem] = tpu_holders.problems(scan_real(tmp_path, lockfile))
    assert problem.code == "tpu-stale-lock" and problem.fatal
    assert "belongs to user alice and this user cannot open it" in problem.message
    assert f"rm {lockfile}" in problem.fix


@pytest.mark.parametrize("proc_locks", ["/proc/locks", "missing"])
def test_the_lock_held_by_this_process_is_named_and_kept(tmp_path, proc_locks):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")  # /proc/self/fd names the real path
    lockfile = str(tmp_path / "link" / "libtpu_lockfile")
    fd = os.open(lockfile, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.lockf(fd, os.F_TLOCK, 0)  # as JAX's libtpu would in the notebook's process
        found = scan_real(tmp_path, lockfile, proc_locks=str(tmp_path / proc_locks)
                          if proc_locks == "missing" else proc_locks)
        [h] = found.holders
        assert (h.pid, h.own, h.locks_lockfile) == (os.getpid(), True, True)
        [problem] = tpu_holders.problems(found, modules={"jax": sys})
        assert "this notebook's own process" in problem.message and "jax" in problem.message
        # Looking must not have dropped it (closing any fd of the file would have).
        assert locked_by(lockfile) == [os.getpid()]
    finally:
        os.close(fd)


# --- refused before anything starts, only on a TPU plan ------------------------------------

HELD = Scan((Holder(4242, "python3 jax_job.py", "root", ("/dev/vfio/0",), True),), 0,
            tpu_holders.LOCKFILE, "held")




def test_preflight_checks_holders_on_a_tpu_plan_only(monkeypatch, private_state):
    def must_not_scan():
        raise AssertionError("a CPU run looked for TPU holders")

    monkeypatch.setattr(tpu_holders, "scan", must_not_scan)
    for device in (None, "CPU", "CUDA"):
        assert preflight.check(Cell("index"), {}, device_type=device) == {"fatal": [],
                                                                          "notes": []}
    monkeypatch.setattr(tpu_holders, "scan", lambda: HELD)
    found = preflight.check(Cell("index"), {}, device_type="TPU")
    assert [p.code for p in found["fatal"]] == ["tpu-held"]
    assert "pid 4242 (`python3 jax_job.py`, user root)" in found["fatal"][0].message
    # If colab_xla is wrong about a holder, the user can make it a note and run anyway.
    found = preflight.check(Cell("index"), {}, device_type="TPU", refuse_tpu_holders=False)
    assert found["fatal"] == [] and [p.code for p in found["notes"]] == ["tpu-held"]


def test_a_held_tpu_is_a_note_with_colab_xla_tpu_holders_warn_or_its_env_for_the_replicas():
    from colab_xla.notebook.defaults import Defaults

    assert Defaults.read({}).refuses_tpu_holders({})
    assert not Defaults.read({"COLAB_XLA_TPU_HOLDERS": "warn"}).refuses_tpu_holders({})
    # --env sets it for the replicas, whose environment is where it is read
    assert not Defaults.read({}).refuses_tpu_holders({"COLAB_XLA_TPU_HOLDERS": "warn"})
    assert Defaults.read({"COLAB_XLA_TPU_HOLDERS": "warn"}).refuses_tpu_holders(
        {"COLAB_XLA_TPU_HOLDERS": "refuse"})


def fake_tpu_host(monkeypatch, scan):
    monkeypatch.setattr(hardware, "detect", lambda environ=None: hardware.Hardware(
        pjrt_device=None, tpu_chips=4, tpu_cores_per_chip=1))
    monkeypatch.setattr(torch_xla_import, "import_torch_xla", lambda: None)
    monkeypatch.setattr(tpu_holders, "scan", scan)

    def started(*args, **kwargs):
        raise AssertionError("replicas were started")

    monkeypatch.setattr(one_off, "Supervisor", started)


def test_run_cell_on_a_held_tpu_is_refused_before_anything_starts(monkeypatch, private_state):
    fake_tpu_host(monkeypatch, lambda: HELD)
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(preflight.PreflightError) as info:
        targets.run_cell("index", announce=None)
    assert info.value.problem.code == "tpu-held"
    assert "pid 4242 (`python3 jax_job.py`, user root) has /dev/vfio/0 open and locks the " \
           "libtpu lock file" in str(info.value)
    assert "kill 4242" in str(info.value)
    assert set(psutil.Process().children(recursive=True)) == before


@pytest.mark.parametrize("where", ["environment", "--env"])
def test_run_cell_on_a_held_tpu_runs_with_a_note_when_told_to_warn(monkeypatch, private_state,
                                                                  where):
    fake_tpu_host(monkeypatch, lambda: HELD)
    env = {"COLAB_XLA_TPU_HOLDERS": "warn"}
    if where == "environment":
        monkeypatch.setenv("COLAB_XLA_TPU_HOLDERS", "warn")
    monkeypatch.setattr(one_off, "_said", set())  # (a note is said once per notebook process)
    said = []
    with pytest.raises(AssertionError, match="replicas were started"):  # not refused
        targets.run_cell("index", announce=said.append, env=env if where == "--env" else None)
    assert any("The TPU is in use" in note and "pid 4242" in note for note in said), said


def test_the_magic_says_who_holds_the_tpu(monkeypatch, private_state, capsys):
    from IPython.core.error import UsageError
    from IPython.testing import globalipapp

    fake_tpu_host(monkeypatch, lambda: HELD)
    globalipapp.start_ipython()
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "colab_xla")
    try:
        result = ip.run_cell("%%xla_spawn\nindex")
    finally:
        ip.run_line_magic("unload_ext", "colab_xla")
    assert isinstance(result.error_in_exec, UsageError)
    assert "The TPU is in use" in str(result.error_in_exec)
    assert "pid 4242" in str(result.error_in_exec)


def test_doctor_says_who_holds_the_tpu_and_the_problem_on_a_tpu(monkeypatch, private_state):
    monkeypatch.setattr(hardware, "detect", lambda environ=None: hardware.Hardware(
        pjrt_device=None, tpu_chips=4, tpu_cores_per_chip=1))
    monkeypatch.setattr(doctor, "installed_version", lambda p: "2.9.0")
    monkeypatch.setattr(tpu_holders, "scan", lambda: HELD)
    report = doctor.diagnose(environ={}, history=[])
    assert ("TPU held by", "pid 4242 (has /dev/vfio/0 open and locks the libtpu lock file)") \
        in report.facts
    assert [p.code for p in report.problems] == ["tpu-held"]
    assert "kill 4242" in report.render()
    monkeypatch.setattr(tpu_holders, "scan", lambda: Scan((), 0, tpu_holders.LOCKFILE, "absent"))
    report = doctor.diagnose(environ={}, history=[])
    assert ("TPU held by", "nobody") in report.facts and report.problems == []


def test_doctor_on_cpu_states_holders_without_a_problem(monkeypatch, private_state):
    monkeypatch.setattr(tpu_holders, "scan", lambda: HELD)
    report = doctor.diagnose(environ={"PJRT_DEVICE": "CPU"}, history=[])
    assert dict(report.facts)["TPU held by"].startswith("pid 4242")
    assert "tpu-held" not in [p.code for p in report.problems]
