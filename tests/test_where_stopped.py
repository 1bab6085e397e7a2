"""A run that is cut says where each replica was (issue 33): its line in the cell, the
cell's function it was in, the line's source and the call it was in, replicas at the same
place together, in the error's text and the HTML view; taken from each process's stacks
(colab_xla.wire.stacks), also from a replica blocked in native code.

Units of the dump's reading first, then real runs: replica 2 sleeping in a function while
the others wait in a rendezvous, cut by ``--timeout`` and by an Interrupt, in both
simulations and in a session; and a torch runtime rank waiting in gloo's all_reduce (native
code) while another rank failed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from colab_xla import runtimes
from colab_xla.notebook.launch import Launch
from colab_xla.notebook.outcome import STOPPED, RunObserver, XlaSpawnError
from colab_xla.notebook.targets import run_cell
from colab_xla.notebook.targets.session import SessionOptions, new_session
from colab_xla.notebook.views import html as html_view
from colab_xla.wire import stacks

# -- units -------------------------------------------------------------------------------

CELL = "/tmp/run-1/xla_cell_3_ab.py"
SITE = "/venv/lib/python3.11/site-packages"
DUMP = f"""Thread 0x00007f0000000002 (most recent call first):
  File "{SITE}/colab_xla/runtimes/gloo_collectives.py", line 130 in exchange
  File "{SITE}/torch_xla/core/xla_model.py", line 1386 in rendezvous
  File "{SITE}/colab_xla/replica/execution.py", line 300 in noted_rendezvous
  File "{CELL}", line 9 in <module>
  File "{SITE}/colab_xla/replica/execution.py", line 120 in _run_cell

Current thread 0x00007f0000000001 (most recent call first):
  File "{CELL}", line 6 in slow_load
  File "{CELL}", line 8 in <module>
  File "{SITE}/colab_xla/replica/execution.py", line 120 in _run_cell

Thread 0x00007f0000000003 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "{SITE}/colab_xla/replica/serve.py", line 80 in serve
"""
LINES = ["# %%xla_spawn", "import time", "import torch_xla.core.xla_model as xm",
         "def slow_load():", "    x = 1", "    time.sleep(1000)", "",
         "slow_load() if index == 2 else None", "xm.rendezvous('ready')"]


@pytest.mark.quick
@pytest.mark.stacks("colab", "kaggle")
def test_a_dump_says_each_replica_threads_line_function_source_and_call():
    threads = stacks.parse(DUMP)
    assert sorted(threads) == [0x7f0000000001, 0x7f0000000002, 0x7f0000000003]
    waiting = stacks.place(threads[0x7f0000000002], CELL, LINES)
    # colab_xla's wrapper of xm.rendezvous and its collectives are not the place: the
    # torch_xla call the cell made is.
    assert waiting == ("line 9: `xm.rendezvous('ready')` "
                       "(in rendezvous, torch_xla/core/xla_model.py:1386)")
    assert stacks.place(threads[0x7f0000000001], CELL, LINES) == (
        "line 6 in slow_load: `time.sleep(1000)`")
    assert stacks.place(threads[0x7f0000000003], CELL, LINES) == (
        "not in the cell (in wait, threading.py:327)")
    assert stacks.grouped({3: "a", 0: "a", 2: "b", 1: "a"}) == [("a", [0, 1, 3]), ("b", [2])]
    found = stacks.of_threads({10: DUMP}, {0: (10, 0x7f0000000002), 2: (10, 0x7f0000000001),
                                           5: (11, 0x7f0000000002), 6: (10, 0xdead)})
    assert sorted(found) == [0, 2]  # (process 11 did not answer; no thread 0xdead)
    # Asked: processes 10 and 11 (11 never answered); 12 was not asked (no pipe).
    asked = stacks.Asked({}, {10: 0, 11: 0}, 0.0)
    places = stacks.places({10: DUMP}, asked, {0: (10, 0x7f0000000002), 5: (11, 1),
                                               6: (10, 0xdead), 7: (12, 1)}, CELL, LINES)
    assert places == {0: waiting, 5: stacks.UNANSWERED}


@pytest.mark.quick
@pytest.mark.stacks("colab", "kaggle")
def test_a_process_that_is_gone_is_not_asked_and_says_nothing(tmp_path):
    never = tmp_path / "stacks-1.txt"
    never.write_text("")
    gone = os.getpid() + 10_000_000  # (no such process)
    assert stacks.collect(stacks.ask({gone: str(never)}), timeout=0.2) == {}


@pytest.mark.quick
@pytest.mark.stacks("colab", "kaggle")
def test_a_dump_is_read_only_once_whole_and_gives_each_threads_frames(tmp_path):
    """A dump is read once its end mark is written (a dump half written is not read), and
    gives each thread's frames, innermost first, but those of the thread that took them."""
    ready, release = threading.Event(), threading.Event()

    def waiting_here():
        ready.set()
        release.wait(10)

    waiter = threading.Thread(target=waiting_here)
    waiter.start()
    ready.wait(10)
    try:
        text = stacks.dump(sys._current_frames(), leave_out=threading.get_ident())
    finally:
        release.set()
        waiter.join()
    threads = stacks.parse(text)
    assert threading.get_ident() not in threads and waiter.ident in threads
    functions = [f.function for f in threads[waiter.ident]]
    here = functions.index("waiting_here")  # below Event.wait, above the thread's start
    assert functions[0] == "wait" and functions[-1] == "_bootstrap" and 0 < here, functions
    assert threads[waiter.ident][here].filename == __file__
    dump = tmp_path / "stacks-1.txt"
    dump.write_text("an earlier dump\n" + stacks.END)
    asked = stacks.Asked({1: str(dump)}, {1: dump.stat().st_size}, time.monotonic())
    half = text[:len(text) // 2]
    with open(dump, "a") as stream:
        stream.write(half)
    assert stacks.collect(asked, timeout=0) == {}  # half written: not read
    with open(dump, "a") as stream:
        stream.write(text[len(half):])
    assert stacks.collect(asked, timeout=0) == {1: text}
    unchanged = stacks.Asked({1: str(dump)}, {1: dump.stat().st_size}, time.monotonic())
    assert stacks.collect(unchanged, timeout=0) == {}  # nothing new: no answer


# A replica process whose main thread sleeps in a function while another of its threads runs
# bursts of Python, one per line on stdin: as a session replica's command thread does when
# the interrupt that follows the question for its stacks arrives.
BUSY_BESIDE_A_SLEEPER = """
import json, sys, threading, time
from colab_xla.wire import stacks
def bursts():
    for _ in sys.stdin:
        for i in range(50):
            json.loads(json.dumps({"i": [i, str(i)]}))
            threading.Event().wait(0)
threading.Thread(target=bursts, daemon=True).start()
def sleeping():
    print(stacks.register(sys.argv[1]), threading.get_ident(), flush=True)
    time.sleep(1000)
sleeping()
"""


@pytest.mark.timeout(120)
@pytest.mark.stacks("colab", "kaggle")
def test_asking_a_process_whose_threads_run_python_never_crashes_it(tmp_path):
    """Asked again and again while another of its threads runs Python, a process stays up
    and answers where its sleeping thread is, every time. (faulthandler's dump on a signal,
    which walked the threads without Python's lock, killed it with SIGSEGV within a few
    hundred rounds: a session ended by an interrupt.)"""
    child = subprocess.Popen([sys.executable, "-c", BUSY_BESIDE_A_SLEEPER, str(tmp_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        target, main = child.stdout.readline().split()
        for round_ in range(1000):
            asked = stacks.ask({child.pid: target})
            child.stdin.write("now\n")
            child.stdin.flush()
            answered = stacks.collect(asked, timeout=30)
            assert child.poll() is None, f"died in round {round_}: {child.returncode}"
            frames = stacks.parse(answered[child.pid])[int(main)]
            assert [f.function for f in frames[-2:]] == ["sleeping", "<module>"], frames
    finally:
        child.kill()
        child.wait()


ASKING_ITSELF = """
import json, os, sys, threading
from colab_xla.wire import stacks
target = stacks.register(sys.argv[1])
real = stacks._answer_once
def only_the_caller(side):  # the stacks thread never answers here: the caller must
    if threading.current_thread() is side.thread:
        threading.Event().wait()
    real(side)
stacks._answer_once = only_the_caller
def asking_itself():
    asked = stacks.ask({os.getpid(): target})
    stacks.answer_asked()
    return stacks.collect(asked, timeout=0)  # one look: no waiting
print(json.dumps([asking_itself() for _ in range(3)]))
"""


@pytest.mark.timeout(60)
@pytest.mark.stacks("colab", "kaggle")
def test_a_question_is_answered_before_answer_asked_returns(tmp_path):
    """What a session replica's command thread calls before it takes an interrupt: the
    question is answered once it returns (its stacks say where the interrupt found it,
    though the notebook does not wait for them), and the caller is there."""
    done = subprocess.run([sys.executable, "-c", ASKING_ITSELF, str(tmp_path)],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    for answered in json.loads(done.stdout):
        (answer,) = answered.values()
        functions = [f.function for frames in stacks.parse(answer).values() for f in frames]
        assert "asking_itself" in functions and answer.endswith(stacks.END), answer


REGISTERING_AGAIN = """
import json, os, sys
from colab_xla.wire import stacks
first_dir, second_dir = sys.argv[1:3]
said = [stacks.register(os.path.join(first_dir, "missing")), stacks.registered()]
first = stacks.register(first_dir)
old = stacks._registered[0].thread
second = stacks.register(second_dir)
old.join(10)
asked = stacks.ask({os.getpid(): first})  # (its pipe has no reader now: not asked)
said += [old.is_alive(), dict(asked.sizes), stacks.registered() == second]
said.append(list(stacks.collect(stacks.ask({os.getpid(): second}), timeout=10)))
print(json.dumps(said))
"""


@pytest.mark.timeout(60)
@pytest.mark.stacks("colab", "kaggle")
def test_a_process_registered_again_elsewhere_answers_there_alone(tmp_path):
    """No stacks files where none can be made (the replica runs on, its place unsaid); a
    process registered in a second directory answers there, and the first one's thread
    ends (no thread and descriptors left per registration)."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    done = subprocess.run([sys.executable, "-c", REGISTERING_AGAIN, str(first), str(second)],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    missing, none, old_alive, asked_first, second_is_it, answered = json.loads(done.stdout)
    assert missing is None and none is None
    assert old_alive is False and asked_first == {} and second_is_it is True
    assert len(answered) == 1


# -- real runs -----------------------------------------------------------------------------

def waiting(sleeper: int, seconds: int, then: str = "") -> str:
    """A cell whose replica ``sleeper`` sleeps ``seconds`` in a function (line 5) while the
    others wait for it in a rendezvous (line :data:`RENDEZVOUS_LINE`). Each says ``ready``
    once it is there: a thread of its own prints it when the cell's thread is in
    ``slow_load`` or in the rendezvous, so that an Interrupt sent once every replica said
    it finds each at its place, never still on its way (a print of the cell's own thread
    just before the call raced it: a replica cut as it returned from the print, seen on a
    loaded machine)."""
    return textwrap.dedent(f"""
        import sys, threading, time
        import torch_xla.core.xla_model as xm
        def slow_load():
            time.sleep({seconds})
        def say_ready_once_there(cell_thread):  # (it prints as the cell's replica)
            def calls():
                frame = sys._current_frames().get(cell_thread)
                while frame is not None:
                    yield frame.f_code.co_name
                    frame = frame.f_back
            while cell_thread in sys._current_frames() and not (
                    {{'slow_load', 'rendezvous'}} & set(calls())):
                time.sleep(0.001)
            print('ready', flush=True)
        threading.Thread(target=say_ready_once_there, daemon=True,
                         args=(threading.get_ident(),)).start()
        if index == {sleeper}:
            slow_load()
        xm.rendezvous('ready')
        """).lstrip("\n") + then


HUNG = waiting(2, 1000)
RENDEZVOUS_LINE = 2 + HUNG.splitlines().index("xm.rendezvous('ready')")  # (line 1: the magic's)
AT_RENDEZVOUS = (f"at line {RENDEZVOUS_LINE}: `xm.rendezvous('ready')` "
                 "(in rendezvous, torch_xla/core/xla_model.py:")
IN_SLOW_LOAD = "replica 2 at line 5 in slow_load: `time.sleep(1000)`"


class InterruptWhenAllPrinted(RunObserver):
    """The notebook's Interrupt once every replica printed ``ready``; with ``group``, as
    Jupyter's Interrupt is: SIGINT to the kernel's process group, these pids (the
    replicas') first."""

    def __init__(self, replicas: int, group=()):
        self.replicas, self.printed, self.group = replicas, set(), group

    def output(self, outcome, origin, lines):
        if "ready" in lines and isinstance(origin, int):
            self.printed.add(origin)
            if len(self.printed) == self.replicas:
                for pid in self.group:
                    os.kill(pid, signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)


def assert_places(outcome):
    said = str(XlaSpawnError(outcome))
    assert f"  replicas 0-1, 3 {AT_RENDEZVOUS}" in said, said
    assert f"  {IN_SLOW_LOAD}" in said, said
    assert [r.state for r in outcome.replicas.values()] == [STOPPED] * 4
    assert outcome.replicas[2].error.place == "line 5 in slow_load: `time.sleep(1000)`"
    assert IN_SLOW_LOAD in html_view.render(outcome)  # (the widget's summary, and its tab:)
    assert "at line 5 in slow_load" in outcome.replicas[2].error.render()


# (A --timeout long enough for every replica to reach its place on a loaded machine; an
# Interrupt once every replica printed the line before it.)
SLOW_MACHINE_SECONDS = 10


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_timeout_says_where_each_replica_was():
    outcome = run_cell(HUNG, announce=None, label="Cell In[5]", replicas=4,
                       timeout=SLOW_MACHINE_SECONDS)
    assert_places(outcome)


@pytest.mark.xla
@pytest.mark.timeout(300)
@pytest.mark.parametrize("simulate", ["processes", "threads"])
def test_an_interrupt_says_where_each_replica_was(simulate):
    outcome = run_cell(HUNG, announce=None, label="Cell In[5]", replicas=4, simulate=simulate,
                       observer=InterruptWhenAllPrinted(4))
    assert outcome.interrupted
    assert_places(outcome)


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_an_interrupted_session_cell_says_where_each_replica_was():
    session = new_session(SessionOptions(replicas=4), {}, announce=None)
    try:
        outcome = run_cell(HUNG, announce=None, label="Cell In[5]", session=session,
                           observer=InterruptWhenAllPrinted(4))
        assert outcome.interrupted
        assert_places(outcome)
    finally:
        session.stop()


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_session_cell_interrupted_as_jupyter_does_says_where_the_replica_in_a_sleep_was():
    """Jupyter's Interrupt is a SIGINT to the kernel's process group: the session's replica
    processes get it too, before the notebook asks where they are. The sleeping replica took
    it at once and was back between cells when asked ("not in the cell (in run,
    multiprocessing/process.py:108)"): the one the others waited for was the one lost."""
    session = new_session(SessionOptions(replicas=4), {}, announce=None)
    try:
        pids = sorted({rep.pid for rep in session.replicas.values()})
        outcome = run_cell(HUNG, announce=None, label="Cell In[5]", session=session,
                           observer=InterruptWhenAllPrinted(4, group=pids))
        assert outcome.interrupted
        assert_places(outcome)
    finally:
        session.stop()


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_rank_blocked_in_gloos_native_all_reduce_still_says_where_it_was():
    # Rank 1 took another branch while rank 0 waits in all_reduce, inside gloo (C++, the
    # GIL released, no Python code running): --timeout cuts the run, and rank 0's place is
    # read from its stack all the same.
    outcome = run_cell(textwrap.dedent("""
        import time, torch, torch.distributed as dist
        def step():
            t = torch.ones(1)
            dist.all_reduce(t)
        if index == 1:
            time.sleep(1000)
        step()
        """).lstrip("\n"), launch=Launch(runtime=runtimes.get("torch")), announce=None,
        label="Cell In[5]", replicas=2, timeout=SLOW_MACHINE_SECONDS)
    assert [r.state for r in outcome.replicas.values()] == [STOPPED, STOPPED]
    place = outcome.replicas[0].error.place
    assert place.startswith("line 5 in step: `dist.all_reduce(t)` (in all_reduce, "
                            "torch/distributed/distributed_c10d.py:"), place
    assert outcome.replicas[1].error.place == "line 7: `time.sleep(1000)`"


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_replica_whose_native_code_keeps_pythons_lock_is_said_not_to_have_answered():
    # Replica 0 sleeps in libc's sleep called through ctypes.PyDLL, which keeps Python's
    # lock: its stacks thread cannot run, and its place says why it is unknown.
    outcome = run_cell(textwrap.dedent("""
        import ctypes, time
        if index == 0:
            ctypes.PyDLL(None).sleep(60)
        time.sleep(1000)
        """).lstrip("\n"), announce=None, label="Cell In[5]", replicas=2,
        timeout=SLOW_MACHINE_SECONDS)
    assert [r.state for r in outcome.replicas.values()] == [STOPPED, STOPPED]
    assert outcome.replicas[0].error.place == stacks.UNANSWERED
    assert outcome.replicas[1].error.place == "line 5: `time.sleep(1000)`"
    said = str(XlaSpawnError(outcome))
    # What a user reads: that the place is unknown, why, and what shows it.
    assert ("  replica 0 at an unknown place: its process did not answer within 1 s "
            "(native code that keeps Python's lock") in said, said
    assert "py-spy dump --native --pid PID" in said, said


# -- the stall notice while a run goes on ----------------------------------------------------

STALLS = waiting(1, 6, then="print('after', flush=True)\n")


class Notices(RunObserver):
    """Every stall notice, and the output lines around them, in order."""

    def __init__(self):
        self.seen = []

    def stalled(self, outcome, stall):
        self.seen.append(("notice", stall.notice(outcome) if stall else None))

    def output(self, outcome, origin, lines):
        self.seen += [("line", line) for line in lines]


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_stall_says_where_each_replica_is_stops_nothing_and_goes_when_output_resumes():
    notices = Notices()
    outcome = run_cell(STALLS, announce=None, label="Cell In[5]", replicas=2, stall=1,
                       observer=notices)
    assert outcome.ok  # nothing was stopped
    said = [n for kind, n in notices.seen if kind == "notice"]
    assert said and re.match(r"No output for \d+ s; where each replica is now:\n", said[0]), said
    assert f"replica 0 {AT_RENDEZVOUS}" in said[0]
    assert "replica 1 at line 5 in slow_load: `time.sleep(6)`" in said[0]
    assert len([n for n in said if n]) >= 2  # refreshed while it lasted
    # It went when output came again: the first line after it clears it.
    after = notices.seen.index(("line", "after"))
    assert ("notice", None) in notices.seen[:after + 1]
    assert said[-1] is None


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_targeted_cell_in_a_collective_stalls_and_the_notice_names_the_idle_replicas():
    session = new_session(SessionOptions(replicas=3), {}, announce=None)
    try:
        notices = Notices()
        outcome = run_cell(textwrap.dedent("""
            import torch_xla.core.xla_model as xm
            xm.rendezvous("all of us")
            """).lstrip("\n"), announce=None, label="Cell In[5]", session=session,
            targets="0-1", stall=1, timeout=SLOW_MACHINE_SECONDS, observer=notices)
        assert sorted(outcome.replicas) == [0, 1] and outcome.idle == [2]
        said = [n for kind, n in notices.seen if kind == "notice" and n]
        assert said, notices.seen
        assert "replicas 0-1 at line 3: `xm.rendezvous(\"all of us\")`" in said[0], said[0]
        assert said[0].endswith("replica 2 does not run this cell (--targets): a collective "
                                "in it waits for it forever"), said[0]
    finally:
        session.stop()


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_no_stall_notice_with_stall_0_and_a_bad_stall_is_refused():
    from colab_xla.errors import OptionError

    notices = Notices()
    assert run_cell(STALLS, announce=None, replicas=2, stall=0, observer=notices).ok
    assert [kind for kind, _ in notices.seen if kind == "notice"] == []
    for bad in (-1, float("nan")):
        with pytest.raises(OptionError, match="--stall"):
            run_cell("1", announce=None, replicas=1, stall=bad)


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_the_text_view_in_a_kernel_prints_the_stall_notice_and_a_cut_runs_places():
    from _kernel import Kernel  # tests/ is on sys.path

    with Kernel() as k:
        assert k.run("%load_ext colab_xla").status == "ok"
        reply = k.run("%%xla_spawn -n 2 --no-widget --stall 1\n" + STALLS, timeout=200)
        assert reply.status == "ok", reply.text
        assert re.search(r"\[colab_xla\] No output for \d+ s; where each replica is now:\n"
                         r"\[colab_xla\] replica 0 " + re.escape(AT_RENDEZVOUS),
                         reply.stdout), reply.stdout
        cut = k.run("%%xla_spawn -n 4 --no-widget --timeout 10\n" + HUNG, timeout=200)
        assert cut.status == "error" and "replica 2 at line 5 in slow_load" in cut.text, cut.text
