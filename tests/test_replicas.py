"""Real torch_xla CPU replicas forked from this process through xmp.spawn."""

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil
import pytest

from _runs import LABEL, run  # tests/ is on sys.path

from colab_xla.notebook import replicas, supervisor
from colab_xla.notebook.launch import Launch
from colab_xla.runtimes import torch_xla as torch_xla_runtime
from colab_xla.replica import execution as replica_execution
from colab_xla.notebook.outcome import DONE, FAILED, XlaSpawnError

pytestmark = [pytest.mark.xla, pytest.mark.timeout(180), pytest.mark.stacks("colab", "kaggle")]


@pytest.mark.quick
@pytest.mark.parametrize("n", [1, 4])
def test_every_replica_runs_and_reports(n):
    outcome = run("""
        import torch_xla.runtime as xr
        print(f"replica {index} of {xr.world_size()}")
        index * 10
        """, n)
    assert sorted(outcome.replicas) == list(range(n))
    for o, rep in outcome.replicas.items():
        assert rep.state == DONE and rep.error is None
        assert list(rep.log.tail) == [("stdout", f"replica {o} of {n}")]
        assert rep.pid != os.getpid() and rep.elapsed > 0
    assert outcome.results() == {o: o * 10 for o in range(n)} and outcome.ok


def test_the_notebook_process_never_initializes_xla_nor_changes_its_environment():
    env_before = {k: os.environ.get(k) for k in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    outcome = run("import torch\n(torch.ones(2, device=device) + index).cpu()", 2)
    assert outcome.ok
    assert torch_xla_runtime.runtime_initialized() is False
    assert {k: os.environ.get(k) for k in env_before} == env_before


def test_notebook_names_are_visible_and_replica_names_shadow_them():
    def double(x):
        return 2 * x

    user_ns = {"K": 21, "double": double, "index": "notebook's", "device": "notebook's"}
    outcome = run("(double(K), index, str(device))", 2, user_ns=user_ns)
    assert {o: v[:2] for o, v in outcome.results().items()} == {0: (42, 0), 1: (42, 1)}
    assert all(v[2].startswith("xla:") for v in outcome.results().values())


def test_device_is_created_on_first_use_only():
    outcome = run("""
        before = 'device' in globals()
        d = device
        (before, 'device' in globals(), str(d))
        """, 2)
    # a process per replica, each with its one device (as on a TPU v4 host)
    assert {o: v for o, v in outcome.results().items()} == {0: (False, True, "xla:0"),
                                                             1: (False, True, "xla:0")}
    outcome = run("str(device)", 2, simulate="threads")  # one process: a device per replica
    assert outcome.results() == {0: "xla:0", 1: "xla:1"}


def test_cell_definitions_pickle_by_reference_in_replicas_and_by_value_to_the_notebook():
    outcome = run("""
        import pickle, multiprocessing as mp
        def square(x):
            return x * x
        class Point:
            def __init__(self, x):
                self.x = x
        assert pickle.loads(pickle.dumps(square)) is square
        assert type(pickle.loads(pickle.dumps(Point(1)))) is Point
        with mp.get_context("fork").Pool(2) as pool:   # pickles `square` from another thread
            squares = pool.map(square, range(4))
        (squares, Point(index))
        """, 2)
    assert outcome.ok, outcome.failed and outcome.replicas[outcome.failed[0]].error.render()
    for o, (squares, point) in outcome.results().items():
        assert squares == [0, 1, 4, 9]
        assert type(point).__name__ == "Point" and point.x == o


def test_an_edited_cell_runs_the_new_code():
    first = run("def f():\n    return 'old'\nf()", 1)
    second = run("def f():\n    return 'new'\nf()", 1)
    assert first.results() == {0: "old"} and second.results() == {0: "new"}


@pytest.mark.quick
def test_xla_tensors_in_results_arrive_on_cpu():
    import torch

    outcome = run("""
        import torch
        t = torch.full((2,), float(index), device=device)
        {"t": t, "nested": [t * 2], "param": torch.nn.Parameter(t + 1)}
        """, 2)
    for o, value in outcome.results().items():
        assert value["t"].device.type == "cpu"
        assert torch.equal(value["t"], torch.full((2,), float(o)))
        assert torch.equal(value["nested"][0], torch.full((2,), 2.0 * o))
        assert isinstance(value["param"], torch.nn.Parameter)
        assert value["param"].device.type == "cpu"
    assert torch_xla_runtime.runtime_initialized() is False


@pytest.mark.quick
def test_one_replica_raising_fails_only_that_replica_with_the_cells_line():
    outcome = run("""
        print("before", index)
        if index == 2:
            raise ValueError(f"bad replica {index}")
        index
        """, 4)
    assert outcome.failed == [2]
    bad = outcome.replicas[2]
    assert bad.state == FAILED and bad.text == "before 2"
    assert bad.error.ename == "ValueError" and "bad replica 2" in bad.error.evalue
    assert f"{LABEL}, line 4, in <module>" in bad.error.traceback
    assert outcome.results() == {0: 0, 1: 1, 3: 3}
    text = XlaSpawnError(outcome).render()
    assert "[replica 2]" in text and text.count("Traceback") == 1


def test_same_error_on_every_replica_is_shown_once():
    outcome = run("raise RuntimeError('everywhere')", 4)
    groups = outcome.error_groups()
    assert len(groups) == 1 and groups[0][1] == [0, 1, 2, 3]


def test_exit_status_zero_is_a_normal_end_and_nonzero_a_failure():
    outcome = run("import sys\nprint('leaving')\nsys.exit(3 if index else 0)", 2)
    assert outcome.replicas[0].state == DONE and outcome.replicas[0].text == "leaving"
    assert outcome.replicas[1].error.kind == "exit"
    assert "sys.exit(3)" in outcome.replicas[1].error.render()


def test_a_dying_replica_process_is_reported_with_its_exit_code():
    outcome = run("import os\nprint('last words', flush=True)\nos._exit(7)", 1)
    rep = outcome.replicas[0]
    assert rep.state == FAILED and rep.error.kind == "died"
    assert "exit code 7" in rep.error.evalue and rep.text == "last words"


def test_a_value_that_cannot_be_pickled_fails_only_its_replica():
    outcome = run("import threading\nthreading.Lock() if index == 1 else index", 3)
    assert outcome.failed == [1]
    error = outcome.replicas[1].error
    assert error.kind == "result"
    assert "lock" in error.evalue and "could not be sent back" in error.evalue
    assert outcome.results() == {0: 0, 2: 2}


def test_the_shared_lock_and_a_private_run_directory():
    outcome = run("""
        import os, stat
        with lock:
            print("holding the lock", index)
        run_dir = os.path.dirname(__file__)
        (run_dir, stat.S_IMODE(os.stat(run_dir).st_mode))
        """, 2)
    assert outcome.ok
    run_dir, mode = outcome.results()[0]
    assert mode == 0o700 and not os.path.exists(run_dir)  # private while running, gone after
    assert outcome.replicas[1].text == "holding the lock 1"


KILLED_HOLDING_A_LOCK = """
import os
from colab_xla.notebook import shared_lock
with shared_lock.new_lock():
    print(shared_lock.manager().address, flush=True)
    os.kill(os.getpid(), 9)  # (a kernel restarted, or shut down at once)
"""


@pytest.mark.quick
def test_a_notebook_killed_with_a_lock_leaves_no_pymp_directory_and_the_next_sweeps_it():
    """The lock's manager listens in the notebook process's work directory, which the
    next notebook process removes once the first is gone: no /tmp/pymp-* left for good."""
    own_tmp = tempfile.mkdtemp(prefix="lock-")  # (this test's own /tmp; tmp_path is too
    try:  # long a prefix for a socket's path)
        env = {**os.environ, "TMPDIR": own_tmp}
        done = subprocess.run([sys.executable, "-c", KILLED_HOLDING_A_LOCK], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == -signal.SIGKILL, done.stderr
        socket_path = done.stdout.strip()
        work = os.path.join(own_tmp, f"colab_xla-{os.getuid()}", "work")
        assert os.path.dirname(os.path.dirname(socket_path)) == work, socket_path
        assert [name for name in os.listdir(own_tmp) if name.startswith("pymp-")] == []
        subprocess.run([sys.executable, "-c", "from colab_xla.notebook import state\n"
                        "state.own_dir('work')"], env=env, check=True, timeout=60)
        assert not os.path.exists(os.path.dirname(socket_path))  # the dead one's, swept
    finally:
        shutil.rmtree(own_tmp, ignore_errors=True)


def test_the_locks_manager_listens_in_the_work_directory_unless_the_path_is_too_long(
        monkeypatch):
    from colab_xla.notebook import shared_lock, state

    monkeypatch.setattr(state, "own_dir", lambda kind: "/tmp/w")
    assert shared_lock._address().startswith("/tmp/w/lock-")
    monkeypatch.setattr(state, "own_dir", lambda kind: "/tmp/" + "w" * 100)
    assert shared_lock._address() is None  # (multiprocessing's own address, in /tmp)


def test_the_lock_is_there_only_for_a_cell_whose_text_names_it():
    # What the README says: a Manager lock costs a few ms per run, so only such cells get one.
    outcome = run("('lo' + 'ck') in globals()", 2)
    assert outcome.results() == {0: False, 1: False}
    outcome = run("lock  # named\n'lock' in globals() and hasattr(lock, 'acquire')", 2)
    assert outcome.results() == {0: True, 1: True}


@pytest.mark.quick
def test_no_process_of_a_run_outlives_it():
    outcome = run("import os\nos.getpid()", 2)
    pid = outcome.results()[0]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.quick
def test_a_driver_that_never_ends_is_waited_for_once_a_run_not_at_each_release(monkeypatch):
    # A cut run is released when it is stopped and again when it ends; a driver blocked
    # on a forkserver that is still importing must not be waited for at each of them.
    monkeypatch.setattr(replicas, "_DRIVER_JOIN_SECONDS", 0.3)
    fresh = replicas.FreshReplicas("test-release", Launch("fork"), plan=None)
    kills = []
    monkeypatch.setattr(fresh.processes, "kill", lambda: kills.append(True))
    stuck = threading.Event()
    driver = threading.Thread(target=stuck.wait, daemon=True)
    driver.start()
    try:
        fresh.release(driver)  # kills until the 0.3 s are over, every 50 ms
        first = len(kills)
        fresh.release(driver)  # the time is over: one kill more, no wait
    finally:
        stuck.set()
        driver.join()
    assert first > 1 and len(kills) == first + 1


# --- output capture ---------------------------------------------------------------------------


C_WRITES = """
    import ctypes, os
    libc = ctypes.CDLL(None)
    libc.write(2, f"C stderr from {index}\\n".encode(), len(f"C stderr from {index}\\n"))
    libc.printf(b"C printf %d\\n", index)
    print("python", index)
    """


def test_c_level_writes_are_captured_for_the_process_not_lost():
    outcome = run(C_WRITES, 2, simulate="threads")
    assert outcome.ok
    process = outcome.processes["process 0"].tail_text()  # 2 replicas are threads of 1 process
    assert sorted(process.splitlines()) == ["C printf 0", "C printf 1",
                                            "C stderr from 0", "C stderr from 1"]
    assert [outcome.replicas[o].text for o in range(2)] == ["python 0", "python 1"]


THREADS_PRINT = """
    import threading
    def grandchild():
        print("grandchild of", index)
    def child():
        print("child of", index)
        t = threading.Thread(target=grandchild)
        t.start()
        t.join()
    t = threading.Thread(target=child)
    t.start()
    t.join()
    print("python", index)
    """


@pytest.mark.parametrize("simulate", ["threads", "processes"])
def test_a_thread_a_cell_starts_prints_as_its_replica_even_beside_others_in_a_process(
        simulate):
    outcome = run(THREADS_PRINT, 2, simulate=simulate)
    assert outcome.ok
    assert not any(p.tail_text() for p in outcome.processes.values())  # none as "process 0"
    for o in range(2):
        assert outcome.replicas[o].text.splitlines() == [
            f"child of {o}", f"grandchild of {o}", f"python {o}"]


def test_c_level_writes_of_replica_processes_go_each_to_its_replica():
    outcome = run(C_WRITES, 2)
    assert outcome.ok and outcome.processes == {}
    for o in range(2):
        assert sorted(outcome.replicas[o].text.splitlines()) == [
            f"C printf {o}", f"C stderr from {o}", f"python {o}"]


def test_c_level_writes_of_a_one_replica_process_go_to_that_replica():
    outcome = run("""
        import ctypes
        ctypes.CDLL(None).printf(b"from C\\n")
        print("from Python")
        """, 1)
    assert sorted(outcome.replicas[0].text.splitlines()) == ["from C", "from Python"]
    assert outcome.processes == {}


def test_c_level_output_read_before_the_frame_naming_its_replica_still_goes_to_it(monkeypatch):
    """While output flows, a ring's frames come without a wake-up: the loop can be woken by
    a process's C-level line before it has read the frame saying which replica the process
    runs. Forced here: the loop's first wait returns only once C-level output is there,
    and says only that."""
    loops = []
    read_until_done = supervisor.Supervisor._read_until_done

    def remember(self, *args, **kw):
        loops.append(self)
        return read_until_done(self, *args, **kw)

    real_select, forced = select.select, []

    def c_output_first(readable, writable, errors, timeout=None):
        sources = [fd for fd, (rank, _) in loops[0]._pipes.fd_sources.items()
                   if rank >= 0 and fd in readable] if loops else []
        if sources and not forced:
            forced.append(real_select(sources, [], [], 60)[0])
            return forced[0], [], []
        return real_select(readable, writable, errors, timeout)

    monkeypatch.setattr(supervisor.Supervisor, "_read_until_done", remember)
    monkeypatch.setattr(select, "select", c_output_first)
    outcome = run("""
        import ctypes
        ctypes.CDLL(None).printf(b"from C\\n")
        print("from Python")
        """, 2)
    assert forced and forced[0], "the loop was never woken by C-level output first"
    assert outcome.processes == {}
    for o in range(2):
        assert sorted(outcome.replicas[o].text.splitlines()) == ["from C", "from Python"]


def test_a_c_level_line_written_in_pieces_keeps_a_python_line_out_of_it():
    """C stdio may write one line in pieces (glibc's printf: its text, then its conversion).
    Forced here: the replica writes a line's first piece, waits until the notebook has read
    it, prints a Python line (which comes through the ring), then ends the C-level line."""
    outcome = run("""
        import fcntl, os, struct, termios, time
        def unread():  # bytes of this process's fd 1 the notebook has not read yet
            return struct.unpack("i", fcntl.ioctl(1, termios.FIONREAD, b"0000"))[0]
        os.write(1, b"from C, ")
        deadline = time.monotonic() + 30
        while unread() and time.monotonic() < deadline:
            time.sleep(0.001)  # (polling the pipe, until the notebook has read the piece)
        assert unread() == 0, "the notebook never read the first piece"
        print("from Python", flush=True)
        os.write(1, b"in two pieces\\n")
        """, 2)
    for o in range(2):
        assert outcome.replicas[o].error is None, outcome.replicas[o].error
        assert sorted(outcome.replicas[o].text.splitlines()) == [
            "from C, in two pieces", "from Python"], outcome.replicas[o].text


def test_a_c_level_piece_without_its_line_end_is_shown_when_the_run_ends():
    outcome = run("""
        import os
        os.write(1, b"Password for nothing: ")
        """, 1)
    assert outcome.replicas[0].text == "Password for nothing: "


@pytest.mark.quick
def test_output_is_ordered_complete_and_unmixed_per_replica():
    outcome = run("""
        import sys
        for i in range(3000):
            print(f"r{index}-line{i}", "x" * (i % 50))
            if i % 700 == 0:
                sys.stdout.write(f"r{index}-partial-"); sys.stdout.flush(); print("end")
        """, 4)
    for o, rep in outcome.replicas.items():
        lines = [t for _, t in rep.log.tail]
        full = open(rep.log.path).read().splitlines()
        assert rep.log.lines_total == len(full) == 3000 + 5
        expected = []
        for i in range(3000):
            expected.append(f"r{o}-line{i} " + "x" * (i % 50))
            if i % 700 == 0:
                expected.append(f"r{o}-partial-end")
        assert full == expected and lines == expected[-len(lines):]


def test_carriage_returns_update_a_line_in_place_and_tqdm_auto_is_text():
    outcome = run("""
        from tqdm.auto import tqdm
        for _ in tqdm(range(50), mininterval=0, ascii=True):
            pass
        tqdm.__module__
        """, 1)
    rep = outcome.replicas[0]
    assert outcome.results() == {0: "tqdm.std"}
    assert rep.log.lines_total == 1, rep.log.tail  # one bar line, updated in place
    assert "50/50" in rep.text and "\r" not in rep.text


def test_a_replica_printing_then_raising_keeps_every_line():
    outcome = run("""
        import sys
        for i in range(500):
            print(index, i)
        sys.stdout.write("no newline before the error")
        raise RuntimeError("after printing")
        """, 2)
    for o, rep in outcome.replicas.items():
        lines = open(rep.log.path).read().splitlines()
        assert lines[:500] == [f"{o} {i}" for i in range(500)]
        assert lines[-1] == "no newline before the error"
        assert rep.error.ename == "RuntimeError"


# --- in a separate process ------------------------------------------------------------------

_PY = [sys.executable, "-u", "-c"]


@pytest.mark.stacks("kaggle")
def test_refuses_before_forking_when_the_runtime_is_already_initialized():
    script = textwrap.dedent("""
        import torch_xla, multiprocessing
        torch_xla.device()   # initializes the runtime in this (the "notebook's") process
        from colab_xla.notebook.preflight import RuntimeInitializedError
        from colab_xla.notebook.targets import run_cell
        try:
            run_cell("index", replicas=2, announce=None)
        except RuntimeInitializedError as exc:
            print("REFUSED", exc)
        print("children:", len(multiprocessing.active_children()))
        """)
    env = dict(os.environ, PJRT_DEVICE="CPU")
    done = subprocess.run(_PY + [script], capture_output=True, text=True, timeout=120, env=env)
    assert "REFUSED" in done.stdout, done.stdout + done.stderr
    assert "torch_xla.device()" in done.stdout and "restart the runtime" in done.stdout
    assert "children: 0" in done.stdout


def test_interrupt_kills_every_replica_process_and_returns_promptly(tmp_path):
    marker = tmp_path / "pids"
    script = textwrap.dedent(f"""
        from colab_xla.notebook.targets import run_cell
        cell = '''
        import os, time
        with open({str(marker)!r} + str(index), "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.1)
        '''
        outcome = run_cell(cell, replicas=2, announce=None)
        print("interrupted:", outcome.interrupted,
              sorted((o, r.state) for o, r in outcome.replicas.items()))
        """)
    proc = subprocess.Popen(_PY + [script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    files = [tmp_path / f"pids{o}" for o in range(2)]
    while not all(f.exists() and f.read_text() for f in files):  # replicas are running
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    replica_pids = {int(f.read_text()) for f in files}
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=15)  # answered within seconds, not hung
    assert "interrupted: True [(0, 'stopped'), (1, 'stopped')]" in out, out + err
    assert not any(psutil.pid_exists(p) for p in replica_pids)


@pytest.mark.stacks()
@pytest.mark.timeout(300)
def test_eight_replicas_times_100k_lines_arrive_complete_in_order_with_bounded_memory():
    run("1", 8)  # warm: imports and the lock manager are not what is measured
    rss_before = psutil.Process().memory_info().rss
    outcome = run("for i in range(100_000):\n    print(f'r{index} line {i}')", 8)
    growth = psutil.Process().memory_info().rss - rss_before
    assert outcome.ok
    for o, rep in outcome.replicas.items():
        with open(rep.log.path) as f:
            assert f.read().splitlines() == [f"r{o} line {i}" for i in range(100_000)]
        assert rep.log.lines_total == 100_000 and len(rep.log.tail) <= 400
    assert growth < 64 * 2**20, f"the notebook's process grew by {growth / 2**20:.0f} MiB"


def test_instances_of_notebook_classes_come_back_as_those_classes():
    # "Defined in the notebook": module __main__, found in the notebook's namespace (the
    # shell's user module need not be sys.modules["__main__"]).
    Counter = type("Counter", (), {"__module__": "__main__", "__init__":
                                   lambda self, n: setattr(self, "n", n)})
    outcome = run("Counter(index)", 2, user_ns={"Counter": Counter})
    assert outcome.ok
    for o, value in outcome.results().items():
        assert type(value) is Counter and value.n == o


# Replica 0 of the run below sends its START frame (which makes its entry in the outcome)
# only once replicas 1-3 run their cell, which they do after sending theirs: its entry comes
# last whatever the threads' timing. The replicas run in a process forked from this one,
# with its own copy of these.
_REAL_MAIN = replica_execution.main
_RUNNING = threading.Semaphore(0)
_ZERO_WAITED = []


def _replica_0_starts_last(index, job):
    if index == 0:
        _ZERO_WAITED.append(all(_RUNNING.acquire(timeout=60) for _ in range(3)))
    _REAL_MAIN(index, job)


def _cell_ran(index):
    if index == 0:
        return list(_ZERO_WAITED)  # [True]: it started after 1, 2 and 3 ran
    _RUNNING.release()
    return index


def test_the_outcome_lists_replicas_by_ordinal_whatever_order_they_started_in(monkeypatch):
    from colab_xla.notebook.outcome import RunObserver

    class Starts(RunObserver):
        order = []

        def started(self, outcome, ordinal):
            self.order.append(ordinal)

    monkeypatch.setattr(replicas, "run_replica", _replica_0_starts_last)
    outcome = run("import time\ntime.sleep(0.05 * (3 - index))\nran(index)", 4,
                  user_ns={"ran": _cell_ran}, observer=Starts(),  # and 3 finishes first
                  simulate="threads")  # (the semaphore is shared by threads)
    assert outcome.results() == {0: [True], 1: 1, 2: 2, 3: 3}
    assert Starts.order[-1] == 0 and sorted(Starts.order) == [0, 1, 2, 3]  # 0 came last...
    assert list(outcome.replicas) == [0, 1, 2, 3]  # ...and is listed first


def test_an_error_in_a_view_ends_the_run_cleanly(monkeypatch):
    from colab_xla.notebook.outcome import RunObserver

    class Broken(RunObserver):
        def started(self, outcome, ordinal):
            raise RuntimeError("view broke")

    thread_errors = []
    monkeypatch.setattr("threading.excepthook", thread_errors.append)
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(RuntimeError, match="view broke"):
        # 8 replica processes: the launcher is still starting some when the view breaks
        # at the first start (processes started after the first kill outlived the run)
        run("import time\ntime.sleep(30)", 8, observer=Broken())
    assert thread_errors == []  # the driver thread saw its pool end; it did not crash
    assert set(psutil.Process().children(recursive=True)) <= before


@pytest.mark.parametrize("simulate", ["processes", "threads"])
def test_a_notebook_whose_print_ray_replaced_forks_replicas_that_print(simulate, monkeypatch):
    """Ray's driver replaces the notebook's ``print`` with its tqdm_ray.safe_print, which
    takes a lock of Ray's (seen: after a host's actor died). Held by another thread as the
    notebook forks, that lock was never free in a replica, whose first print waited for
    ever; a replica prints with Python's own print."""
    import builtins

    tqdm_ray = pytest.importorskip("ray.experimental.tqdm_ray")
    # What Ray's driver does: its manager, and (the first time in a process) its print.
    manager = tqdm_ray.instance()
    monkeypatch.setattr(builtins, "print", tqdm_ray.safe_print)
    held, let_go = threading.Event(), threading.Event()

    def hold():
        with manager.lock:
            held.set()
            let_go.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    try:
        outcome = run("""
            print('printed', index)
            index
            """, 2, simulate=simulate, timeout=60)
    finally:
        let_go.set()
        holder.join(10)
    assert outcome.results() == {0: 0, 1: 1}, outcome
    assert sorted(t for rep in outcome.replicas.values() for _, t in rep.log.tail) == [
        "printed 0", "printed 1"]
