"""A session replica's interrupts (colab_xla.replica.serve): asynchronous exceptions in a
thread, SIGINT in the main thread."""

import sys
import threading

import pytest

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_an_interrupted_session_cell_leaves_the_next_one_free_to_set_a_profiler():
    """A session replica's cell ended by dropping an interrupt that came too late with
    ``PyThreadState_SetAsyncExc(thread, NULL)``: up to Python 3.12 that leaves the
    interpreter's "asynchronous exception pending" flag set, and on 3.11 a later cell that set
    and cleared a profiler spun for ever (this test failed there; 3.12 and 3.13 pass either way)."""
    from colab_xla.replica.serve import Interruptible

    profiled = compile("import sys\nsys.setprofile(lambda *a: None)\n", "<cell>", "exec")
    last_line = compile("sys.setprofile(None)", "<cell>", "eval")
    looping, made, seen = threading.Event(), [], []

    def replica():
        made.append(Interruptible())
        try:
            with made[0].running("cell 1"):
                looping.set()
                while True:
                    pass
        except KeyboardInterrupt:
            seen.append("interrupted")
        with made[0].running("cell 2"):
            ns = {}
            exec(profiled, ns)
            seen.append(eval(last_line, ns))
        seen.append(sum(1 for _ in range(10_000)))  # and nothing comes later

    thread = _replica_thread(replica)
    assert looping.wait(30)
    made[0].interrupt("cell 1")
    thread.join(60)
    assert not thread.is_alive(), "the second cell spins"
    assert seen == ["interrupted", None, 10_000]


def test_an_interrupt_swallowed_by_a_finalizer_comes_again_at_the_cells_next_line():
    """CI's soak, cell 296: the kernel's Interrupt (jupyter_client signals the kernel's
    whole process group: the replicas too) reached a replica while the garbage collector
    ran a finalizer in the middle of the cell's line; Python only reports an exception
    raised there, the replica slept on, and the session ended. Here the notebook's interrupt
    (the SIGINT its urgent pipe's thread sends: one of the process group's is not an
    interrupt) comes in a suspended generator's ``finally``, run by ``gc.collect()``."""
    import subprocess

    script = """
import gc, threading, time
from colab_xla.replica.serve import Interruptible

def generator():
    try:
        yield
    finally:  # run by the garbage collector: the interrupt lands here
        urgent = threading.Thread(target=cell.interrupt, args=("c",))
        urgent.start()
        urgent.join()
        for _ in range(1000):
            pass

class Cycle:
    pass

cell = Interruptible()  # in the main thread, as in a session's replica process
try:
    with cell.running("c"):
        garbage = Cycle()
        garbage.me, garbage.suspended = garbage, generator()
        next(garbage.suspended)
        del garbage
        gc.collect()
        time.sleep(600)
except KeyboardInterrupt:
    print("interrupted")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # (a hang is the sleep's 600 s)
    assert done.returncode == 0 and done.stdout.strip() == "interrupted", done
    assert "Exception ignored" not in done.stderr, done.stderr  # (taken: not said)


def _replica_thread(target) -> threading.Thread:
    """``target`` started in a thread of its own, not the main thread: there, a session
    replica's interrupts are asynchronous exceptions."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_session_cell_never_clears_an_asynchronous_exception_it_may_have_been_sent(
        monkeypatch):
    """Clearing one (``PyThreadState_SetAsyncExc(thread, NULL)``) leaves the pending flag set
    up to Python 3.12 (see the test above): a cell not interrupted sends nothing at its end,
    and an interrupted one replaces what may still be pending by an exception it takes."""
    from colab_xla.replica import serve

    sent = []
    real = serve._async_raise
    monkeypatch.setattr(serve, "_async_raise",
                        lambda thread, exc: sent.append(exc) or real(thread, exc))
    done = []

    def replica():
        cell = serve.Interruptible()
        with cell.running("quiet"):
            pass
        done.append(list(sent))
        try:
            with cell.running("interrupted"):
                cell.interrupt("interrupted")
                while True:
                    pass
        except KeyboardInterrupt:
            pass
        done.append(list(sent))

    _replica_thread(replica).join(60)
    assert done == [[], [KeyboardInterrupt, serve._Dropped]]


def test_a_session_replica_whose_sigint_was_lost_is_still_interrupted():
    """The soak's cell 830 on CI: a SIGINT that arrives as the replica's ``time.sleep`` goes
    back to sleep (woken a moment before by the notebook asking for its stack) is taken
    only when the sleep ends, and an asynchronous exception does not wake a sleep: the
    session ended ("did not stop within 2 s"). Here the first SIGINT is lost on purpose
    (a race of microseconds is not made to order); the replica must still stop."""
    import subprocess

    script = """
import threading, time
from colab_xla.replica.serve import Interruptible

class LosesTheFirst(Interruptible):
    sent = 0
    def _signal(self):
        self.sent += 1
        if self.sent > 1:
            super()._signal()

cell = LosesTheFirst()  # in the main thread, as in a session's replica process
try:
    with cell.running("c"):
        threading.Thread(target=cell.interrupt, args=("c",)).start()
        time.sleep(600)
except KeyboardInterrupt:
    print("interrupted after", cell.sent, "signals")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # (a hang is the sleep's 600 s)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("interrupted after"), done.stdout
    assert int(done.stdout.split()[2]) >= 2, done.stdout  # (the first was lost)
