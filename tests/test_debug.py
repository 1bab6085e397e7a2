"""``%xla_debug``: pdb's post-mortem on a session replica's last exception, its prompts
answered from the notebook (colab_xla.notebook.debugger, colab_xla.replica.serve.debug).

Through the IPython-free core (a session, scripted answers), in both simulations, then in a
real kernel whose input box is answered as a person would (jupyter_client's stdin channel).
"""

from __future__ import annotations

import re

import pytest

from colab_xla.notebook import debugger
from colab_xla.notebook.targets import run_cell
from colab_xla.notebook.targets.session import SessionOptions, new_session
from _kernel import Kernel  # tests/ is on sys.path

FAILS = """def load(d):
    secret = 41 + index
    return 1 / d
kept = index * 10
load(0) if index in (1, 2) else None"""


class Person:
    """Answers each prompt with the next of ``answers``; keeps what was shown and asked."""

    def __init__(self, *answers):
        self.answers, self.seen = list(answers), []

    def ask(self, prompt):
        answer = self.answers.pop(0)
        self.seen.append(prompt + answer + "\n")
        return answer

    def show(self, text):
        self.seen.append(text)

    @property
    def text(self):
        return "".join(self.seen)


@pytest.fixture(params=["processes", "threads"])
def failed_session(request):
    """A session of 3 replicas whose last cell failed in replicas 1 and 2."""
    session = new_session(SessionOptions(replicas=3, simulate=request.param), {},
                          announce=None)
    try:
        outcome = run_cell(FAILS, session=session, announce=None, label="Cell In[3]")
        assert outcome.failed == [1, 2], outcome.failed
        yield session
    finally:
        session.stop()


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_the_debugger_opens_at_the_failing_line_of_the_lowest_failed_replica(failed_session):
    person = Person("p secret", "w", "up", "p kept", "q")
    assert failed_session.debug(None, ask=person.ask, show=person.show) == "ended"
    said = person.text
    assert said.startswith(  # which replica it opened, then where it raised
        "colab_xla: pdb on replica 1's last exception (q ends it; the session goes on).\n"
        "ZeroDivisionError: division by zero\n> Cell In[3](4)load()\n-> return 1 / d\n"), said
    assert "(Pdb) p secret\n42\n" in said  # replica 1's local, alive in its frame
    assert "(Pdb) p kept\n10\n" in said  # one frame up: the cell's globals
    # The session goes on, its globals as they were.
    after = run_cell("kept + 1", session=failed_session, announce=None)
    assert after.results() == {0: 1, 1: 11, 2: 21}


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_another_replica_or_none_at_all_is_said_and_a_silent_replica_is_left(failed_session):
    person = Person("p secret", "q")
    assert failed_session.debug(2, ask=person.ask, show=person.show) == "ended"
    assert person.text.startswith("colab_xla: pdb on replica 2's last exception")
    assert "(Pdb) p secret\n43\n" in person.text
    quiet = Person()
    assert failed_session.debug(0, ask=quiet.ask, show=quiet.show) == "ended"
    assert quiet.text == (debugger.opening("replica 0")
                          + "This replica's last cell raised nothing: no exception to debug.\n")
    with pytest.raises(debugger.DebugError, match="this session's replicas are 0-2"):
        failed_session.debug(5, ask=quiet.ask, show=quiet.show)
    # A command that takes longer than the answer's bound: the debugger is left, the
    # session goes on.
    slow = Person("import time; time.sleep(5)", "q")
    ended = debugger.converse
    try:
        debugger.converse = lambda *a, **kw: ended(*a, **{**kw, "answer_seconds": 1.0})
        assert failed_session.debug(1, ask=slow.ask, show=slow.show) == (
            "the replica did not answer within 1 s")
    finally:
        debugger.converse = ended
    assert run_cell("kept", session=failed_session, announce=None).results() == {
        0: 0, 1: 10, 2: 20}
    assert run_cell("1", session=failed_session, announce=None).ok
    with pytest.raises(debugger.DebugError, match="no replica failed in this session's last"):
        failed_session.debug(None, ask=quiet.ask, show=quiet.show)


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_xla_debug_in_a_kernel_asks_through_the_notebooks_input_box():
    with Kernel() as k:
        assert k.run("%load_ext colab_xla").status == "ok"
        none = k.run("%xla_debug")  # no session: it says how to get one
        assert none.status == "error" and "Start a session (%xla_session start)" in none.evalue
        assert k.run("%xla_session start -n 3", timeout=200).status == "ok"
        failed = k.run("%%xla_spawn --no-widget\n" + FAILS, timeout=200)
        assert failed.status == "error" and "2 failed" in failed.text, failed.text
        reply, prompts = k.run_answering("%xla_debug", ["p secret", "up", "p kept", "q"])
        assert reply.status == "ok", reply.text
        # (A replica forked from a kernel has IPython's pdb: its prompt, colours and the
        # lines around the current one.)
        assert len(prompts) == 4 and {p.strip() for p in prompts} <= {"ipdb>", "(Pdb)"}, prompts
        said = re.sub(r"\x1b\[[0-9;]*m", "", reply.stdout)
        assert re.search(r"> Cell In\[\d+\]\(4\)load\(\)", said), said
        assert "\n42\n" in said and "\n10\n" in said, said
        again = k.run("%%xla_spawn --no-widget -o r\nkept", timeout=200)
        assert again.status == "ok", again.text
        assert k.run("assert r == {0: 0, 1: 10, 2: 20}, r").status == "ok"
        assert k.run("%xla_session stop").status == "ok"


def test_a_cluster_host_that_does_not_answer_the_debugger_ends_it_in_time(monkeypatch):
    """%xla_debug H:R relays pdb through host H's agent: an agent that does not answer
    (its node stuck) ends the debugger within the bound, saying so; nothing waits forever."""
    from types import SimpleNamespace

    from colab_xla.notebook.targets import cluster_session
    from colab_xla.notebook.targets.cluster_session import ClusterSession

    asked = []

    class StuckRay:
        class exceptions:
            GetTimeoutError = TimeoutError

        @staticmethod
        def get(ref, timeout=None):
            asked.append(timeout)
            raise TimeoutError("Get timed out: some object(s) not ready.")

    agent = SimpleNamespace(debug=SimpleNamespace(remote=lambda local, answer: ("ref", local)))
    cluster = SimpleNamespace(up=True, check_up=lambda: None, agents=[agent, agent])
    monkeypatch.setattr(cluster_session, "import_ray", lambda: StuckRay)
    session = ClusterSession(cluster, {0: {0: 11}, 1: {0: 12}}, runtime=None)
    shown = []
    ended = session.debug((1, 0), ask=lambda prompt: pytest.fail("no prompt came"),
                          show=shown.append)
    assert ended.startswith("host 1 did not answer within 90 s (TimeoutError: Get timed out")
    assert asked == [debugger.ANSWER_SECONDS + 30]
