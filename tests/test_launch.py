"""Real replicas started every way colab_xla offers: start methods, launchers, one-replica
debugging, --env, --cache, --pull and shared-memory tensors (issue #6)."""

import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from _runs import run  # tests/ is on sys.path

from colab_xla.notebook import launch, state
from colab_xla.runtimes import torch_xla as torch_xla_runtime
from colab_xla.wire import shared_tensors
from colab_xla.notebook.launch import Launch
from colab_xla.notebook.views import text as text_view
from colab_xla.wire.names import UnsendableNames
from colab_xla.notebook.outcome import DONE
from colab_xla.wire.reports import RETURN_PLAIN_DATA
from colab_xla.errors import PreflightError

pytestmark = [pytest.mark.xla, pytest.mark.timeout(240), pytest.mark.stacks("colab", "kaggle")]

_PY = [sys.executable, "-c"]


def notebook_namespace():
    """Names as a notebook defines them: module ``__main__``, so cloudpickle sends the
    function and the class by value, as it would from a kernel."""
    ns = {"__name__": "__main__"}
    exec(textwrap.dedent("""
        import math
        class Point:
            def __init__(self, x):
                self.x = x
        def scaled(v):
            return v * factor
        factor = 10
        """), ns)
    del ns["__builtins__"]
    return ns


CELL_USING_NOTEBOOK_NAMES = """
import os
print("replica", index, "pid", os.getpid())
Point(scaled(index) + math.floor(2.5))
"""


@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.stacks()),
                                    "forkserver"])
def test_without_fork_the_cell_gets_the_notebook_names_it_mentions(method):
    ns = notebook_namespace()
    ns["unrelated"] = threading.Lock()  # not mentioned: not sent, so no error
    outcome = run(CELL_USING_NOTEBOOK_NAMES, 2, user_ns=ns, launch=Launch(method))
    assert outcome.ok, text_view.render(outcome)
    for o, value in outcome.results().items():
        assert type(value) is ns["Point"] and value.x == o * 10 + 2  # the notebook's class
        assert outcome.replicas[o].text.startswith(f"replica {o} pid ")
        assert outcome.replicas[o].pid != os.getpid()
    assert not torch_xla_runtime.runtime_initialized()


def test_the_shared_lock_and_c_level_output_work_without_fork():
    outcome = run("""
        import ctypes
        with lock:
            print("replica", index, "holds the lock")
        ctypes.CDLL(None).printf(b"from C\\n")
        index
        """, 2, launch=Launch("forkserver"))
    assert outcome.ok and outcome.results() == {0: 0, 1: 1}
    # a process per replica: its C output (through the named pipes, by path) is its own
    for o, r in outcome.replicas.items():
        assert sorted(r.text.splitlines()) == ["from C", f"replica {o} holds the lock"], r.text


def test_names_that_cannot_be_loaded_in_the_replica_fail_every_replica_with_what_to_do():
    ns = {"__name__": "__main__"}
    exec(textwrap.dedent("""
        import os
        NOTEBOOK = os.getpid()
        def _load():
            if os.getpid() != NOTEBOOK:
                raise ImportError("only loadable in the notebook")
            return "fine"
        class Fragile:
            def __reduce__(self):
                return (_load, ())
        """), ns)
    outcome = run("print(thing)", 2, user_ns={"thing": ns["Fragile"]()},
                  launch=Launch("forkserver"))
    assert outcome.failed == [0, 1]
    for rep in outcome.replicas.values():
        assert rep.error.kind == "names" and rep.text == ""  # the cell never ran
        shown = rep.error.render()
        assert "ImportError: only loadable in the notebook" in shown
        assert "or use --start-method fork" in shown


@pytest.mark.stacks()
def test_forkserver_is_reused_and_survives_an_interrupted_run(tmp_path):
    first = run("index", 2, launch=Launch("forkserver"))
    server = launch.warm_forkserver()
    assert first.ok and server[1] is False  # started by the run, not now
    marker = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import os, time
        from colab_xla.notebook.targets import run_cell
        from colab_xla.notebook.launch import Launch, warm_forkserver
        run_cell("index", replicas=1, announce=None, launch=Launch("forkserver"))
        print("server", warm_forkserver()[0], flush=True)
        cell = '''
        import os, time
        with open({str(marker)!r} + str(index), "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.1)
        '''
        outcome = run_cell(cell, replicas=2, announce=None, launch=Launch("forkserver"))
        print("interrupted:", outcome.interrupted, flush=True)
        again = run_cell("index * 3", replicas=2, announce=None, launch=Launch("forkserver"))
        print("again:", again.results(), "server", warm_forkserver()[0], flush=True)
        """)
    proc = subprocess.Popen(_PY + [script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    files = [tmp_path / f"pids{o}" for o in range(2)]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    replica_pids = {int(f.read_text()) for f in files}
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "interrupted: True" in out, out + err
    assert not any(psutil.pid_exists(p) for p in replica_pids)
    servers = re.findall(r"server (\d+)", out)
    assert len(servers) == 2 and servers[0] == servers[1], out  # the same warm server
    assert "again: {0: 0, 1: 3}" in out, out + err


def test_waiting_for_the_forkserver_returns_once_it_has_imported_torch_xla():
    # (what a cluster's host agent waits for before it says it is up)
    script = textwrap.dedent("""
        from colab_xla.notebook.launch import wait_forkserver, warm_forkserver
        pid, started = warm_forkserver()
        wait_forkserver()
        with open(f"/proc/{pid}/maps") as maps:
            print("started", started, "torch_xla", "_XLAC" in maps.read(), flush=True)
        """)
    done = subprocess.run(_PY + [script], capture_output=True, text=True, timeout=180)
    assert "started True torch_xla True" in done.stdout, done.stdout + done.stderr


def test_a_notebook_killed_with_its_forkserver_up_leaves_no_pymp_directory():
    # The forkserver's socket goes in the notebook process's work directory, which the
    # next notebook process sweeps once that one is gone; killed (a kernel restarted at
    # once), it left a pymp-* directory with the socket for good. multiprocessing's own
    # directory for the notebook's other uses is not chosen by colab_xla. (A TMPDIR of its
    # own, short: pytest's tmp_path, or a long TMPDIR, is too long a place for a socket.)
    base = tempfile.gettempdir()
    tmp = Path(tempfile.mkdtemp(prefix="fs-", dir=base if len(base) <= 40 else "/tmp"))
    env = {**os.environ, "TMPDIR": str(tmp)}
    try:
        script = textwrap.dedent("""
            import multiprocessing, os, signal
            from multiprocessing import forkserver
            from colab_xla.notebook import state
            from colab_xla.notebook.launch import warm_forkserver
            warm_forkserver()
            print(forkserver._forkserver._forkserver_address, state.own_dir("work"),
                  "tempdir" in multiprocessing.current_process()._config, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            """)
        done = subprocess.run(_PY + [script], capture_output=True, text=True, timeout=180,
                              env=env)
        assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
        address, work, redirected = done.stdout.split()
        assert os.path.dirname(address) == work and redirected == "False", done.stdout
        assert not list(tmp.glob("pymp-*"))
        swept = subprocess.run(_PY + ["from colab_xla.notebook import state\n"
                                      "print(state.own_dir('work'))"],
                               capture_output=True, text=True, timeout=60, env=env)
        assert swept.returncode == 0 and swept.stdout.strip() != work, swept.stderr
        assert not os.path.exists(work)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("why", ["its own directory already", "no room for a socket's path"])
def test_the_forkserver_socket_stays_where_multiprocessing_puts_it(why, monkeypatch,
                                                                  private_state):
    # Where multiprocessing has its directory already (the socket goes there, as it did),
    # and where a socket's path in the work directory would be too long (a long TMPDIR).
    config = multiprocessing.current_process()._config
    if why == "its own directory already":
        monkeypatch.setitem(config, "tempdir", "/somewhere/pymp-x")
    else:
        monkeypatch.delitem(config, "tempdir", raising=False)
    fits = why != "no room for a socket's path"
    monkeypatch.setattr(state, "fits_socket", lambda directory, name: fits)
    before = dict(config)
    with launch._multiprocessing_files_in_work_dir():
        assert config == before
    assert config == before


def test_an_interrupt_while_the_forkserver_imports_starts_no_replica(tmp_path):
    # The first forkserver run waits for the server's imports before anything starts:
    # an Interrupt then ends the cell before the run (KeyboardInterrupt, as while the
    # notebook imports torch_xla), not a run cut while its launcher waits for the
    # server. (The cell's files are looked for too, though a replica forked after its
    # run ended would not find the cell's module either.)
    script = textwrap.dedent(f"""
        import signal, sys, threading, time, traceback
        from colab_xla.notebook.targets import run_cell
        from colab_xla.notebook.launch import Launch, wait_forkserver

        main = threading.main_thread().ident

        def interrupt_in_the_wait():
            # Interrupt once the cell waits for the server's imports (its frames say so),
            # to the main thread itself: its blocked read then ends at once.
            while not any(f.f_code.co_name == "wait_forkserver" for f, _ in
                          traceback.walk_stack(sys._current_frames().get(main))):
                time.sleep(0.01)
            signal.pthread_kill(main, signal.SIGINT)

        def announce(note):
            if "starting the forkserver" in note:  # Interrupt while it imports
                threading.Thread(target=interrupt_in_the_wait, daemon=True).start()

        cell = "open({str(tmp_path)!r} + '/ran' + str(index), 'w').close()"
        try:
            run_cell(cell, replicas=2, announce=announce, launch=Launch("forkserver"))
        except KeyboardInterrupt:
            wait_forkserver()  # (warm now: what it was asked before is done)
            print("interrupted before the run", flush=True)
        else:
            print("the run started", flush=True)
        """)
    done = subprocess.run(_PY + [script], capture_output=True, text=True, timeout=180)
    assert "interrupted before the run" in done.stdout, done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_forkserver_that_dies_while_it_imports_refuses_the_run_saying_what_to_do(tmp_path):
    (tmp_path / "dies_on_import.py").write_text("import os\nos._exit(3)\n")
    script = textwrap.dedent(f"""
        import os
        os.environ["PYTHONPATH"] = {str(tmp_path)!r}  # (the forkserver's: it imports it)
        from colab_xla.errors import SetupError
        from colab_xla.notebook import launch
        from colab_xla.notebook.targets import run_cell
        launch.FORKSERVER_PRELOAD = launch.FORKSERVER_PRELOAD[:2] + ("dies_on_import",)
        try:
            run_cell("index", replicas=2, announce=None, launch=launch.Launch("forkserver"))
        except SetupError as exc:
            print("refused:", exc, flush=True)
        """)
    done = subprocess.run(_PY + [script], capture_output=True, text=True, timeout=180)
    assert "refused: the forkserver ended while it imported torch and torch_xla (EOFError" \
        in done.stdout, done.stdout + done.stderr
    assert "nothing started" in done.stdout and "--start-method fork or spawn" in done.stdout


def test_forkserver_replicas_get_each_runs_environment_not_the_servers():
    for n, extra in ((2, "one"), (3, "two")):
        outcome = run("""
            import os, torch_xla.runtime as xr
            (xr.world_size(), os.environ.get("COLAB_XLA_TEST_VAR"))
            """, n, launch=Launch("forkserver"), env={"COLAB_XLA_TEST_VAR": extra})
        assert outcome.results() == {o: (n, extra) for o in range(n)}
    assert "COLAB_XLA_TEST_VAR" not in os.environ


def test_a_name_that_cannot_be_sent_is_named_before_anything_starts():
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(UnsendableNames) as info:
        run("print(lk, ok)", 2, user_ns={"lk": threading.Lock(), "ok": 1},
            launch=Launch("spawn"))
    message = str(info.value)
    assert "lk (lock): TypeError" in message and "ok (int)" not in message
    assert "--start-method fork" in message
    assert set(psutil.Process().children(recursive=True)) <= before


def test_torch_xla_launch_gives_the_same_results_output_and_errors_as_xmp_spawn():
    cell = """
        print("hello from", index)
        if index == 1:
            raise ValueError("replica one fails")
        index * 2
        """
    outcomes = {name: run(cell, 3, launch=Launch(launcher=name)) for name in ("xmp", "launch")}

    def seen(o):
        return (o.results(), {k: r.text for k, r in o.replicas.items()},
                [(e.ename, e.evalue, tuple(ords)) for e, ords in o.error_groups()],
                {k: r.state for k, r in o.replicas.items()})

    assert seen(outcomes["launch"]) == seen(outcomes["xmp"])
    assert outcomes["xmp"].results() == {0: 0, 2: 4}


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_debug_single_runs_one_replica_outside_the_notebook_process(method):
    outcome = run("""
        import os, torch_xla.runtime as xr
        (index, xr.world_size(), os.getpid())
        """, None, launch=Launch(method, debug_single=True))
    assert outcome.ok
    (index, world, pid), = outcome.results().values()
    assert (index, world) == (0, 1) and pid != os.getpid()
    assert not torch_xla_runtime.runtime_initialized()
    with pytest.raises(ValueError, match="--debug-single: it runs one replica"):
        run("index", 4, launch=Launch(method, debug_single=True))


def test_env_reaches_xla_in_the_replicas_only(tmp_path):
    dump = tmp_path / "dump"
    outcome = run("""
        import os, torch
        print(os.environ["COLAB_XLA_TEST_VAR"])
        (torch.ones(2, device=device) + index).cpu()
        """, 2, env={"XLA_FLAGS": f"--xla_dump_to={dump}", "COLAB_XLA_TEST_VAR": "a=b"})
    assert outcome.ok and all(r.text == "a=b" for r in outcome.replicas.values())
    assert dump.is_dir() and any(dump.iterdir())  # XLA itself read the flag
    assert "COLAB_XLA_TEST_VAR" not in os.environ
    assert "--xla_dump_to" not in os.environ.get("XLA_FLAGS", "")


def test_env_is_planned_with_so_a_bad_value_is_refused_like_the_environment():
    with pytest.raises(PreflightError, match="XLA_USE_SPMD"):
        run("index", 2, env={"XLA_USE_SPMD": "1"})
    with pytest.raises(ValueError, match="--env 1X=2"):
        run("index", 2, env={"1X": "2"})


def test_cache_gets_a_directory_per_process_and_a_rerun_tries_to_load_it(tmp_path):
    cache = tmp_path / "cache"
    # The value, and where torch_xla's persistent cache of this replica's process points
    # (what colab_xla sets; XLA's CPU client then fails to load what it finds there, in
    # words of its own, and compiles again).
    cell = ("import os, torch\n(torch.ones(3, device=device) * 5).cpu(), "
            "os.environ.get('XLA_PERSISTENT_CACHE_PATH'), "
            "os.environ.get('XLA_PERSISTENT_CACHE_READ_ONLY')")
    first = run(cell, 2, cache_dir=str(cache))  # a process per replica on CPU
    assert first.ok and sorted(os.listdir(cache)) == ["process-0", "process-1"]
    written = {o: os.listdir(cache / f"process-{o}") for o in (0, 1)}
    assert all(written.values()), "the first run wrote no compiled program"
    second = run(cell, 2, cache_dir=str(cache))
    assert second.ok
    for outcome in (first, second):
        results = outcome.results()
        assert {o: (v.tolist(), path, ro) for o, (v, path, ro) in results.items()} == {
            o: ([5.0] * 3, str(cache / f"process-{o}"), "0") for o in (0, 1)}
    for o in (0, 1):  # the rerun kept them
        assert set(written[o]) <= set(os.listdir(cache / f"process-{o}"))
    threads = run(cell, 2, cache_dir=str(tmp_path / "threads"), simulate="threads")
    assert threads.ok and os.listdir(tmp_path / "threads") == ["process-0"]  # one process


def test_a_cache_directory_that_cannot_be_made_is_refused_before_anything_runs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"--cache .*file/cache: cannot create it"):
        run("index", 2, cache_dir=str(blocker / "cache"))


def test_pull_brings_names_back_by_ordinal_with_xla_tensors_on_cpu():
    cell = """
        import torch
        model = torch.nn.Linear(3, 2).to(device)
        with torch.no_grad():
            model.weight.fill_(index)
        state = {"step": index, "weights": [model.weight * 2]}
        """
    outcome = run(cell, 3, pull=["model", "state"])
    assert outcome.ok
    models, states = outcome.pulled("model"), outcome.pulled("state")
    assert sorted(models) == sorted(states) == [0, 1, 2]
    for o, model in models.items():
        assert isinstance(model.weight, __import__("torch").nn.Parameter)
        assert model.weight.device.type == "cpu" and float(model.weight.detach().sum()) == 6 * o
        assert states[o]["step"] == o and states[o]["weights"][0].device.type == "cpu"
    assert "Pulled: model (Linear), state (dict)" in __import__(
        "colab_xla.notebook.views.text", fromlist=["render"]).render(outcome)


def test_pull_from_one_replica_sends_only_its_values():
    outcome = run("import os\npid = os.getpid()\nmine = index", 4, pull=["mine"], pull_from=2)
    assert outcome.ok and outcome.pulled("mine") == {2: 2}
    with pytest.raises(ValueError, match="--pull-from 4: this run has 4 replicas"):
        run("mine = 1", 4, pull=["mine"], pull_from=4)


def test_a_name_that_cannot_come_back_is_reported_by_name_and_type_and_the_others_arrive():
    outcome = run("""
        import threading
        good = index + 1
        bad = threading.Lock()
        """, 2, pull=["good", "bad", "missing"])
    assert not outcome.ok and outcome.pulled("good") == {0: 1, 1: 2}
    for rep in outcome.replicas.values():
        assert rep.error.kind == "result"
        assert "--pull bad (lock) could not be sent back" in rep.error.evalue
        assert "--pull missing: no such name in the replica" in rep.error.evalue
        assert rep.error.evalue.endswith(RETURN_PLAIN_DATA)  # (what to send instead)


def test_a_missing_name_alone_is_reported_without_advice_on_what_can_be_sent():
    outcome = run("here = index", 2, pull=["here", "missing"])
    assert outcome.pulled("here") == {0: 0, 1: 1}
    for rep in outcome.replicas.values():
        assert (rep.error.kind, rep.error.evalue) == (
            "result", "--pull missing: no such name in the replica.")


def test_names_that_fail_in_the_replica_and_in_the_notebook_are_all_reported():
    outcome = run("""
        import os, threading
        REPLICA = os.getpid()
        def _load():
            if os.getpid() != REPLICA:
                raise ValueError("cannot be rebuilt here")
        class OnlyHere:
            def __reduce__(self):
                return (_load, ())
        good, bad, odd = index, threading.Lock(), OnlyHere()
        """, 2, pull=["good", "bad", "odd"])
    assert outcome.pulled("good") == {0: 0, 1: 1}
    for rep in outcome.replicas.values():
        message = rep.error.evalue
        assert "--pull odd arrived but could not be loaded in the notebook: ValueError" in message
        assert "--pull bad (lock) could not be sent back" in message
        assert message.count("Return plain data instead") == 1


def _mapped_from_shm(tensor) -> bool:
    """Whether the tensor's memory is a mapping of a (removed) file in /dev/shm."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split()
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return "/dev/shm/colab_xla-" in line
    return False


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_large_tensors_arrive_through_shared_memory_and_small_ones_inline():
    shared_tensors.drop_free_pages()  # (what other tests of this process left)
    outcome = run("""
        import torch
        big = torch.arange(1 << 20, dtype=torch.float32) + index   # 4 MiB
        small = torch.ones(4) * index
        (big, small)
        """, 2, pull=["big"])
    assert outcome.ok
    for o, (big, small) in outcome.results().items():
        assert float(big[0]) == o and float(big[-1]) == (1 << 20) - 1 + o
        assert _mapped_from_shm(big) and not _mapped_from_shm(small)
        assert _mapped_from_shm(outcome.pulled("big")[o])
    assert _run_dirs() == []  # the run's directory is gone; the mapped tensors live on
    pages = shared_tensors.own_pages_dir()
    assert sorted(n.split("-")[0] for n in os.listdir(pages)) == ["held"] * 4
    del big
    assert float(outcome.results()[1][0].sum()) == sum(range(1 << 20)) + (1 << 20)
    del outcome
    assert sorted(n.split("-")[0] for n in os.listdir(pages)) == ["free"] * 4  # kept
    again = run("import torch\ntorch.full((1 << 20,), float(index))", 2)  # 4 MiB: written into them
    assert {o: float(t.sum()) for o, t in again.results().items()} == {0: 0, 1: 1 << 20}
    assert sorted(n.split("-")[0] for n in os.listdir(pages)) == ["free", "free", "held", "held"]


@pytest.mark.parametrize("shm", [True, False], ids=["tmpfs", "no-shm"])
def test_a_runs_pipes_are_made_in_its_shared_memory_directory_else_in_its_own(
        monkeypatch, private_state, shm):
    """In tmpfs a pipe costs ~4 us to make, against ~40 us in a disk's /tmp; where shared
    memory is missing, the run's own directory has them, and output arrives the same."""
    if shm and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    if not shm:
        monkeypatch.setattr(shared_tensors, "make_dir", lambda run_id: None)
    outcome = run("""
        import ctypes, os
        ctypes.CDLL(None).printf(b"from C\\n")
        print("from Python")
        os.path.dirname(os.readlink("/proc/self/fd/1"))
        """, 2)
    assert outcome.ok, outcome
    for o, pipes in outcome.results().items():
        assert sorted(outcome.replicas[o].text.splitlines()) == ["from C", "from Python"]
        if shm:
            assert pipes.startswith(f"/dev/shm/colab_xla-{os.getuid()}-{os.getpid()}-"), pipes
        else:
            assert os.path.dirname(pipes) == os.path.join(
                str(private_state), f"colab_xla-{os.getuid()}", "work", state.kernel_key())
    assert _run_dirs() == [] and os.listdir(state.own_dir("work")) == []  # removed


def _run_dirs():
    """This process's directories in /dev/shm but its own (which it keeps while it lives,
    with its pages), and the runs' directories in its own."""
    own = shared_tensors.own_dir()
    return [d for d in os.listdir("/dev/shm") if d.startswith(
        f"colab_xla-{os.getuid()}-{os.getpid()}-") and f"/dev/shm/{d}" != own] + [
        d for d in os.listdir(own) if d != "pages"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_a_replica_that_dies_while_returning_leaves_no_shared_memory_behind():
    shared_tensors.drop_free_pages()  # (what other tests of this process left)
    pages = shared_tensors.own_pages_dir()
    first = run("import torch\ntorch.ones(1 << 20)", 1)  # its pages are free for the next run
    del first
    assert [n.split("-")[0] for n in os.listdir(pages)] == ["free"]
    outcome = run("""
        import os, torch
        class Dies:
            def __reduce__(self):  # after the tensor before it was written
                os._exit(3)
        [torch.ones(1 << 20), torch.ones(2 << 20), Dies()]
        """, 2)
    assert not outcome.ok and not outcome.results()
    assert _run_dirs() == [] and os.listdir(pages) == []  # claimed by the dead: gone


def test_shared_memory_directory_of_a_dead_notebook_is_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = tmp_path / "shm"
    root.mkdir()
    stale = root / f"colab_xla-{os.getuid()}-{dead.pid}-abc"
    mine = root / f"colab_xla-{os.getuid()}-{os.getpid()}-def"
    other = root / "someone-else"
    stale_pages = root / f"colab_xla-{os.getuid()}-{dead.pid}-pages"
    for d in (stale, mine, other, stale_pages):
        d.mkdir()
    new = shared_tensors.make_dir("xyz", root=str(root))
    assert not stale.exists() and not stale_pages.exists() and mine.exists() and other.exists()
    assert new and os.stat(new).st_mode & 0o777 == 0o700


def test_gone_notebooks_directories_are_looked_for_once_a_minute_not_every_run(
        tmp_path, monkeypatch):
    """make_dir prunes a root at its first run and then at most every PRUNE_SECONDS (it
    runs for every warm session cell); the run's own empty directory goes with one rmdir."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = tmp_path / "shm"
    root.mkdir()
    first = shared_tensors.make_dir("one", root=str(root))
    stale = root / f"colab_xla-{os.getuid()}-{dead.pid}-abc"
    stale.mkdir()
    second = shared_tensors.make_dir("two", root=str(root))
    assert stale.exists()  # within the minute: not looked for
    monkeypatch.setattr(shared_tensors, "PRUNE_SECONDS", 0.0)
    third = shared_tensors.make_dir("three", root=str(root))
    assert not stale.exists()
    (Path(third) / "left.bin").write_bytes(b"x")  # (not empty: removed all the same)
    for made in (first, second, third):
        shared_tensors.remove_dir(made)
        assert not os.path.exists(made)


def test_pull_and_result_outcome_states_are_done_for_plain_values():
    outcome = run("x = [index] * 3\nx", 2, pull=["x"], launch=Launch("forkserver"))
    assert {o: r.state for o, r in outcome.replicas.items()} == {0: DONE, 1: DONE}
    assert outcome.pulled("x") == outcome.results() == {0: [0, 0, 0], 1: [1, 1, 1]}


@pytest.mark.parametrize("how", [Launch(), Launch(debug_single=True)])
def test_replicas_run_parallel_cpu_ops_after_the_notebook_ran_some(how):
    # GNU OpenMP hangs a forked child's first parallel op when the forking thread had
    # used its thread pool. The notebook's main thread has; colab_xla forks from a driver
    # thread that has not, so the replica's own main thread (--debug-single) is safe too.
    torch = pytest.importorskip("torch")
    big = torch.ones(16 << 20)
    torch.empty_like(big).copy_(big)  # a parallel op in this (the "notebook's") thread
    outcome = run("import torch\nfloat(torch.full((16 << 20,), 2.0).sum())",
                  None if how.debug_single else 2, launch=how, timeout=60)
    assert outcome.ok, text_view.render(outcome)
    assert set(outcome.results().values()) == {float(2 * (16 << 20))}
