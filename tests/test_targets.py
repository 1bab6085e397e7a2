"""Where a cell runs (:mod:`colab_xla.notebook.targets`), what it asks
(:mod:`colab_xla.notebook.request`), the environment's defaults
(:mod:`colab_xla.notebook.defaults`) and the one parse of a cell: units, with stand-ins for
the replicas (no XLA runtime), and the magic through a real shell."""

from __future__ import annotations

import ast
import inspect
import pickle
import textwrap
from types import SimpleNamespace

import pytest

from colab_xla.errors import OptionError
from colab_xla.notebook import cluster, targets, torch_xla_import
from colab_xla.notebook.defaults import Defaults
from colab_xla.notebook.launch import Launch
from colab_xla.notebook.outcome import RunOutcome
from colab_xla.notebook.request import CellRequest, LaunchAsked, SessionRequest
from colab_xla.notebook.targets import cluster_one_off, cluster_run, one_off
from colab_xla.notebook.targets import session as session_target
from colab_xla.notebook.targets.cluster_one_off import ClusterOneOff
from colab_xla.notebook.targets.cluster_session import ClusterSession
from colab_xla.notebook.targets.one_off import OneOff
from colab_xla.notebook.targets.session import (Session, SessionError, SessionOptions,
                                                SessionReplica)
from colab_xla.notebook.targets.target import Owned, Target
from colab_xla.runtimes.plan import ReplicaPlan
from colab_xla.wire.cell import Cell, CellModule

from _shell import ip_fixture  # tests/ is on sys.path

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


# -- stand-ins ---------------------------------------------------------------------------------


def a_session(tmp_path, replicas=2, launch=Launch(), **options) -> Session:
    """A session as one that started ``replicas`` CPU replicas would be (none runs)."""
    plan = ReplicaPlan("CPU", replicas, processes=replicas, simulation="processes")
    session = Session(SessionOptions(replicas=replicas, launch=launch, **options), plan,
                      str(tmp_path))
    session.replicas = {i: SessionReplica(i, 1000 + i, i) for i in range(replicas)}
    return session


class _Cluster(SimpleNamespace):
    up = property(lambda self: self.ended is None)

    def check_up(self):
        assert self.up


def a_cluster(session_runtime=None):
    """A connected cluster of two CPU hosts of two replicas (no Ray), with a session of
    ``session_runtime`` if given."""
    connected = _Cluster(ended=None, session=None, cells_run=0,
                         described=[{"device": "CPU", "replicas": 2}] * 2,
                         hosts=["10.0.0.1", "10.0.0.2"])
    if session_runtime is not None:
        connected.session = ClusterSession(connected, {0: {0: 1, 1: 2}, 1: {0: 3, 1: 4}},
                                           runtime=session_runtime)
    return connected


def request(source="index", **asked) -> CellRequest:
    return CellRequest(Cell(source), defaults=Defaults(), **asked)


@pytest.fixture
def no_targets(monkeypatch):
    """Neither a cluster nor a session in this process, whatever other tests left."""
    monkeypatch.setattr(cluster, "_current", None)
    monkeypatch.setattr(targets, "_session", None)


class Ran(Exception):
    """A stand-in Supervisor was reached: the run was not refused."""


def no_replicas(monkeypatch, module, outcome=None):
    """Replace ``module``'s Supervisor: a run gets ``outcome`` (or raises :class:`Ran`)
    instead of starting replicas; the RunRequests it was given are returned."""
    given = []

    class Supervisor:
        def __init__(self, run, plan, run_dir, user_ns, observer, timeout, replicas=None,
                     stall=None):
            given.append(run)

        def run(self):
            if outcome is None:
                raise Ran()
            return outcome

    monkeypatch.setattr(module, "Supervisor", Supervisor)
    return given


# -- where a cell runs: targets.current -------------------------------------------------------


def test_with_nothing_kept_a_cell_is_a_one_off_run(no_targets):
    assert isinstance(targets.current(), OneOff) and isinstance(targets.current(True), OneOff)


def test_this_machines_session_up_or_ended_runs_the_cell_unless_fresh(no_targets, monkeypatch,
                                                                      tmp_path):
    session = a_session(tmp_path)
    monkeypatch.setattr(targets, "_session", session)
    assert targets.current() is session
    assert isinstance(targets.current(fresh=True), OneOff)
    session.ended = "stopped (%xla_session stop)"  # ended, not stopped by the notebook
    assert targets.current() is session
    with pytest.raises(SessionError, match="The session has ended: stopped"):
        session.run(request())


def test_a_connected_cluster_runs_the_cell_on_its_session_if_up_else_on_every_host(
        no_targets, monkeypatch, tmp_path):
    connected = a_cluster()
    monkeypatch.setattr(cluster, "_current", connected)
    chosen = targets.current()
    assert isinstance(chosen, ClusterOneOff) and chosen.cluster is connected
    assert isinstance(targets.current(fresh=True), OneOff)
    connected.session = ClusterSession(connected, {0: {0: 1}}, runtime="jax")
    assert targets.current() is connected.session
    connected.session.ended = "on host 1, replica 3 died (exit code 3)"
    assert isinstance(targets.current(), ClusterOneOff)
    monkeypatch.setattr(targets, "_session", a_session(tmp_path))  # (cannot be, but:)
    assert isinstance(targets.current(), ClusterOneOff)  # the cluster decides first
    monkeypatch.setattr(connected, "ended", "stopped")  # cluster.current(): up ones only
    assert targets.current() is targets._session


def test_the_notebooks_session_is_the_clusters_while_connected(no_targets, monkeypatch,
                                                               tmp_path):
    assert targets.current_session() is None and targets.local_session() is None
    here = a_session(tmp_path)
    monkeypatch.setattr(targets, "_session", here)
    assert targets.current_session() is here and targets.local_session() is here
    monkeypatch.setattr(targets, "_session", None)
    connected = a_cluster("torch_xla")
    monkeypatch.setattr(cluster, "_current", connected)
    assert targets.current_session() is connected.session and targets.local_session() is None


# -- what each target refuses ---------------------------------------------------------------


def owned(target) -> tuple:
    """Every option ``target`` declares its own, in its declaration's order."""
    return tuple(flag for group in target.own_options for flag in group.options)


ALL_ASKED = dict(replicas=3, launch=LaunchAsked("spawn", "launch", False), env={"A": "1"},
                 cache_dir="/tmp/c", simulate="threads")


def test_a_one_off_run_takes_every_option():
    assert owned(OneOff) == ()
    OneOff().refuse(request(**ALL_ASKED))


@pytest.mark.parametrize("asked, flags", [
    (dict(replicas=3), "-n"),
    (dict(launch=LaunchAsked("spawn")), "--start-method"),
    (dict(launch=LaunchAsked(launcher="launch")), "--launcher"),
    (dict(launch=LaunchAsked(debug_single=True)), "--debug-single"),
    (dict(launch=LaunchAsked(runtime="jax")), "--runtime"),
    (dict(env={"A": "1"}, cache_dir="/tmp/c", simulate="threads"), "--env, --cache, --simulate"),
])
def test_a_session_refuses_another_value_of_its_options_with_the_way_out(tmp_path, asked,
                                                                          flags):
    session = a_session(tmp_path)
    with pytest.raises(SessionError) as info:
        session.refuse(request(**asked))
    assert str(info.value) == (
        f"{flags}: this session's replicas were started with their own options (-n 2 "
        "--start-method fork --simulate processes), which a cell cannot change. Run this "
        "cell with --fresh (a one-off run beside the session), or %xla_session restart with "
        "the options you want (%xla_session stop, then %xla_session start ...).")


def test_a_session_takes_its_own_values_and_refuses_a_launch_its_runtime_cannot_make(
        tmp_path):
    session = a_session(tmp_path)
    session.refuse(request(replicas=2, launch=LaunchAsked("fork", runtime="torch_xla")))
    assert owned(session) == ("-n", "--start-method", "--launcher", "--debug-single",
                                   "--runtime", "--devices-per-process", "--env", "--cache",
                                   "--simulate")
    jax = a_session(tmp_path, launch=Launch(runtime="jax", devices_per_process=2))
    jax.refuse(request(launch=LaunchAsked(devices_per_process=2)))
    with pytest.raises(OptionError, match="--runtime jax starts JAX processes itself"):
        jax.refuse(request(launch=LaunchAsked(launcher="launch")))


CLUSTER_REFUSAL = ("{}: a cell on the cluster runs on the replicas %xla_cluster started on "
                   "each host. Give the replicas per host to %xla_cluster (-n); or add --fresh "
                   "to run this cell on this machine instead.")


@pytest.mark.parametrize("runtime", [None, "torch_xla"])
def test_a_cluster_and_its_session_refuse_replicas_of_a_cells_own_with_the_way_out(runtime):
    connected = a_cluster(runtime)
    target = connected.session or ClusterOneOff(connected)
    with pytest.raises(OptionError) as info:
        target.refuse(request(**ALL_ASKED))
    assert str(info.value) == CLUSTER_REFUSAL.format(
        "-n, --start-method, --launcher, --env, --cache, --simulate")
    with pytest.raises(OptionError) as info:
        target.refuse(request(launch=LaunchAsked(debug_single=True)))
    assert str(info.value) == CLUSTER_REFUSAL.format("--debug-single")
    assert set(owned(ClusterOneOff)) == {"-n", "--start-method", "--launcher",
                                              "--debug-single", "--env", "--cache",
                                              "--simulate"}


def test_a_cluster_takes_a_runtime_and_its_session_refuses_another_than_its_own():
    ClusterOneOff(a_cluster()).refuse(request(launch=LaunchAsked(runtime="jax",
                                                                 devices_per_process=2)))
    warm = a_cluster("jax").session
    warm.refuse(request(launch=LaunchAsked(runtime="jax")))
    with pytest.raises(SessionError) as info:
        warm.refuse(request(launch=LaunchAsked(runtime="torch_xla", devices_per_process=2)))
    assert str(info.value) == (
        "--runtime, --devices-per-process: the session's replicas on the cluster were started "
        "with their own options (--runtime jax), which a cell cannot change. Add --fresh to "
        "run this cell on this machine, or %xla_session stop, then %xla_session start with "
        "the options you want.")
    assert {"--runtime", "--devices-per-process"} <= set(owned(warm))


class _Declared(Target):
    """A target of two declared groups, which takes -n 2 as its own value."""

    own_options = (Owned(("-n", "--env"), "{asked}: the first group's ({own})."),
                   Owned(("--runtime",), "{asked}: the second group's.", SessionError))

    def repeats(self, flag, request):
        return flag == "-n" and request.replicas == 2

    def describe_own(self):
        return "-n 2"


def test_the_refusal_reads_a_targets_declaration_against_what_the_request_asks():
    target = _Declared()
    target.refuse(request(replicas=2, cache_dir="/tmp/c", timeout=5))  # its own -n; not its
    with pytest.raises(OptionError) as info:
        target.refuse(request(replicas=3, env={"A": "1"}, launch=LaunchAsked(runtime="jax")))
    assert type(info.value) is OptionError  # the first group asked, in the request's order
    assert str(info.value) == "-n, --env: the first group's (-n 2)."
    with pytest.raises(SessionError, match=r"^--runtime: the second group's\.$"):
        target.refuse(request(replicas=2, launch=LaunchAsked(runtime="jax")))


# One option each (--devices-per-process needs --runtime jax), a value no target has.
ONE_ASKED = {
    "-n": dict(replicas=3), "--start-method": dict(launch=LaunchAsked("spawn")),
    "--launcher": dict(launch=LaunchAsked(launcher="launch")),
    "--debug-single": dict(launch=LaunchAsked(debug_single=True)),
    "--runtime": dict(launch=LaunchAsked(runtime="jax")),
    "--runtime, --devices-per-process": dict(launch=LaunchAsked(runtime="jax",
                                                                devices_per_process=2)),
    "--env": dict(env={"A": "1"}), "--cache": dict(cache_dir="/tmp/c"),
    "--simulate": dict(simulate="threads")}
HOSTS = ("-n", "--start-method", "--launcher", "--debug-single", "--env", "--cache",
         "--simulate")


@pytest.mark.parametrize("asked", ONE_ASKED)
def test_every_target_refuses_the_options_it_declares_and_takes_the_others(tmp_path, asked):
    on_hosts = asked in HOSTS
    for target, refused in (
            (OneOff(), None),
            (a_session(tmp_path), SessionError),
            (ClusterOneOff(a_cluster()), OptionError if on_hosts else None),
            (a_cluster("torch_xla").session, OptionError if on_hosts else SessionError)):
        if refused is None:
            target.refuse(request(**ONE_ASKED[asked]))
            continue
        with pytest.raises(refused) as info:
            target.refuse(request(**ONE_ASKED[asked]))
        assert type(info.value) is refused and str(info.value).startswith(f"{asked}: "), target
        assert info.value.args[0].count("--fresh") == 1  # its way out


# -- the request and the environment's defaults -------------------------------------------------


def test_the_defaults_are_read_from_the_environment_as_each_variable_says():
    assert Defaults.read({}) == Defaults("fork", "processes", "auto", None)
    read = Defaults.read({"COLAB_XLA_START_METHOD": "forkserver", "COLAB_XLA_SIMULATE": "threads",
                          "COLAB_XLA_VIEW": "TEXT", "COLAB_XLA_TPU_HOLDERS": "warn"})
    assert read == Defaults("forkserver", "threads", "text", "warn")
    assert not read.refuses_tpu_holders({})
    # set but empty: a start method that is none (refused by name), the default simulation
    assert Defaults.read({"COLAB_XLA_START_METHOD": "", "COLAB_XLA_SIMULATE": ""}) == \
        Defaults("", "processes")


def test_a_request_reads_the_environment_once_when_it_is_made(monkeypatch):
    monkeypatch.setenv("COLAB_XLA_SIMULATE", "threads")
    made = CellRequest(Cell("index"))
    monkeypatch.setenv("COLAB_XLA_SIMULATE", "processes")
    assert made.defaults.simulate == "threads"
    assert SessionRequest().defaults.simulate == "processes"


def test_run_cell_takes_the_environments_simulation_but_forks_unless_told(monkeypatch,
                                                                          no_targets):
    made = []
    monkeypatch.setattr(OneOff, "run", lambda self, request, observer=None: made.append(request))
    monkeypatch.setenv("COLAB_XLA_START_METHOD", "spawn")  # the magics' default, not run_cell's
    monkeypatch.setenv("COLAB_XLA_SIMULATE", "threads")
    monkeypatch.setenv("COLAB_XLA_TPU_HOLDERS", "warn")
    targets.run_cell("index", replicas=2, pull=["a"], env={"B": "2"})
    [asked] = made
    assert asked.launch.one_off() == Launch()
    assert (asked.defaults.simulate, asked.defaults.tpu_holders) == ("threads", "warn")
    assert (asked.replicas, asked.pull, asked.env, asked.cell.source) == (2, ("a",),
                                                                         {"B": "2"}, "index")
    targets.run_cell("index", launch=Launch("forkserver"))
    assert made[1].launch.one_off() == Launch("forkserver")


def test_a_launch_asked_keeps_what_was_not_asked_for_the_target():
    assert not LaunchAsked().any_asked and LaunchAsked.of(None) == LaunchAsked()
    assert LaunchAsked(default_start_method="spawn").one_off() == Launch("spawn")
    given = Launch("spawn", launcher="launch", debug_single=True)
    assert LaunchAsked.of(given).one_off() == given
    assert LaunchAsked.of(given).within(Launch("forkserver")) == given
    own = Launch("forkserver", runtime="jax")
    assert LaunchAsked().within(own) is None
    assert LaunchAsked(devices_per_process=2).within(own) == Launch(
        "forkserver", runtime="jax", devices_per_process=2)
    with pytest.raises(OptionError, match="--devices-per-process is for --runtime jax"):
        LaunchAsked(devices_per_process=2).one_off()


def test_what_a_request_asks_is_named_as_the_line_names_it():
    assert request().replica_flags_asked() == []
    assert request(**ALL_ASKED).replica_flags_asked() == [
        "-n", "--start-method", "--launcher", "--env", "--cache", "--simulate"]
    assert SessionRequest(replicas=2, env=("A=1",), runtime="jax").given() == [
        "-n", "--env", "--runtime"]
    opts = SessionOptions.asked(SessionRequest(
        start_method=None, env=("A=1",), defaults=Defaults(start_method="forkserver")))
    assert (opts.launch, opts.env) == (Launch("forkserver"), {"A": "1"})
    with pytest.raises(OptionError, match="--env NOVALUE: write KEY=VALUE"):
        SessionOptions.asked(SessionRequest(env=("NOVALUE",)))


# -- the notebook's session and cluster ---------------------------------------------------------


def test_a_session_request_on_a_cluster_takes_only_a_runtime(no_targets, monkeypatch):
    monkeypatch.setattr(cluster, "_current", a_cluster("torch_xla"))
    with pytest.raises(SessionError, match="^-n, --env: on a cluster, each host's replicas "
                                           "are the ones %xla_cluster planned"):
        targets.start_asked_session(SessionRequest(replicas=2, env=("A=1",)), {})
    with pytest.raises(SessionError, match="^a session is up on the cluster: %xla_session "
                                           "restart starts it again"):
        targets.start_asked_session(SessionRequest(runtime="jax"), {})


def test_a_restart_needs_a_session_and_a_cluster_needs_this_machine_without_one(
        no_targets, monkeypatch, tmp_path):
    with pytest.raises(SessionError, match="restart: no session was started"):
        targets.start_asked_session(SessionRequest(), {}, restart=True)
    monkeypatch.setattr(targets, "_session", a_session(tmp_path))
    with pytest.raises(SessionError, match="a session is up on this machine"):
        targets.connect_cluster(hosts=2, replicas=2, local=True)
    monkeypatch.setattr(targets, "_session", None)
    with pytest.raises(OptionError, match="local needs --hosts H and -n N"):
        targets.connect_cluster(hosts=2, local=True)


def test_stopping_the_notebooks_session_forgets_it(no_targets, monkeypatch, tmp_path):
    here = a_session(tmp_path)
    here.ended = "it did not start"
    monkeypatch.setattr(targets, "_session", here)
    assert targets.stop_session() is here and targets.current_session() is None
    assert targets.stop_session() is None



def test_both_sessions_give_every_verb_the_magics_use_and_keep_the_shared_fields_once():
    """%xla_session and %xla_debug reach a session through current_session(): each session
    implements every verb of SessionTarget (none left to the base's NotImplementedError), and
    the fields every session keeps are the base's, set once there."""
    from colab_xla.notebook.targets.session_target import SessionTarget

    for cls in (Session, ClusterSession):
        assert issubclass(cls, SessionTarget)
        for verb in ("run", "describe", "stop", "debug", "describe_start"):
            assert getattr(cls, verb) is not getattr(SessionTarget, verb), (cls, verb)
    shared = {"known", "started_at", "cells_run", "start_seconds", "ended", "last_failed"}
    for cls in (Session, ClusterSession):
        source = textwrap.dedent(inspect.getsource(cls.__init__))
        assigned = {node.attr for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)}
        assert not assigned & shared, (cls, assigned & shared)
    ended = SessionTarget()
    assert ended.up and ended.cells_run == 0 and ended.last_failed == []
    ended.ended = "stopped"
    assert not ended.up

# -- a cell is parsed once ------------------------------------------------------------------


@pytest.fixture
def parses(monkeypatch):
    """Every ``ast.parse`` of a cell (its text begins with its magic's line) in this process
    from now on, by its text. (Only cells': a module imported for the first time on the
    way, torch's say, parses its own sources.)"""
    seen, real = [], ast.parse

    def counted(source, *args, **kwargs):
        if isinstance(source, str) and source.startswith("# %%xla_spawn"):
            seen.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", counted)
    return seen


SOURCE = "import math\nscale = factor * math.pi\nprint(index)\nscale"


def test_a_one_off_run_parses_its_cell_once(monkeypatch, parses, private_state):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setattr(torch_xla_import, "import_torch_xla", lambda: None)
    monkeypatch.setattr(one_off, "_said", set())
    sent = no_replicas(monkeypatch, one_off, RunOutcome("CPU"))
    # spawn: the names the cell uses are sent, so they are looked up too
    targets.run_cell(SOURCE, replicas=2, user_ns={"factor": 2, "unused": 3},
                     launch=Launch("spawn"), announce=None)
    assert len(parses) == 1 and parses[0].endswith(SOURCE)
    assert sorted(pickle.loads(sent[0].names)) == ["factor"]
    assert sent[0].cell.source == SOURCE


def test_a_session_cell_is_parsed_once(monkeypatch, parses, tmp_path, private_state):
    session = a_session(tmp_path)
    sent = no_replicas(monkeypatch, session_target, RunOutcome("CPU"))
    session.run(CellRequest(Cell(SOURCE, label="Cell In[2]"), user_ns={"factor": 2},
                            announce=None))
    assert len(parses) == 1
    assert sorted(pickle.loads(sent[0].names)) == ["factor"]  # its names, from the parse


def test_a_cluster_cell_is_parsed_once_in_the_notebook_and_not_again_on_a_host(
        monkeypatch, parses, private_state):
    """The notebook parses the cell, and its hosts get that parse (pickled, as Ray sends
    it): a host's one-off run compiles it without parsing the text again."""
    started = []

    class Hosts:  # the hosts' events, as _ClusterRun collects them: none; the cell kept
        session_ended = {}

        def __init__(self, *args, **kwargs):
            pass

        def run(self, cell, sent, pull, pull_from, jax):
            started.append((pickle.dumps(cell), sent))
            return RunOutcome("CPU")

    monkeypatch.setattr(cluster_run, "_ClusterRun", Hosts)
    cluster_one_off.run_on_cluster(a_cluster(), SOURCE, user_ns={"factor": 2},
                                   label="Cell In[4]", announce=None)
    assert len(parses) == 1
    [(sent_cell, sent_names)] = started
    # on a host: its agent runs the cell it got as a one-off run of its replicas
    from colab_xla.notebook.cluster.agent import _HostedRun

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setattr(torch_xla_import, "import_torch_xla", lambda: None)
    modules = no_replicas(monkeypatch, one_off, RunOutcome("CPU"))
    host = _HostedRun()
    host.run(1, pickle.loads(sent_cell), sent_names, OneOff(),
             dict(replicas=2, launch=LaunchAsked("spawn"), simulate="processes"), [], None)
    assert host.take(0)["done"] and "outcome" in host.take(0), host.take(0)
    assert len(parses) == 1  # (the notebook's)
    assert modules[0].cell.label == "Cell In[4]"
    assert sorted(pickle.loads(modules[0].names)) == ["factor"]


def test_a_cell_module_compiles_the_cells_parse_without_changing_it(tmp_path, parses):
    cell = Cell("x = 6\nx * 7", label="Cell In[1]")
    first, again = (CellModule.create(cell, str(tmp_path)) for _ in range(2))
    assert len(parses) == 1 and first.path != again.path
    for module in (first, again):
        ns = {}
        exec(module.body, ns)
        assert eval(module.last_expr, ns) == 42
    assert pickle.loads(pickle.dumps(cell)).names == {"x"}


@pytest.mark.xla
@pytest.mark.timeout(300)
def test_a_real_run_parses_its_cell_once_in_the_notebook(parses):
    source = "index * 10  # the cell"
    outcome = targets.run_cell(source, replicas=2, announce=None)
    assert outcome.results() == {0: 0, 1: 10}
    # (importing torch_xla parses torch's own sources: those are not the cell)
    assert [text for text in parses if isinstance(text, str) and source in text] == [
        f"# %%xla_spawn\n{source}"]


# -- the magic: parse, the current target, run, show -----------------------------------------


ip = ip_fixture()


def test_the_magic_runs_its_request_on_the_current_target_and_parses_the_cell_once(
        ip, monkeypatch, parses, no_targets, capsys):
    ran = []

    class Target(targets.Target):
        def refuse(self, request):
            ran.append("refuse")

        def run(self, request, observer=None):
            ran.append(request)
            outcome = RunOutcome("CPU")
            outcome.replica(0).state = "done"
            outcome.replica(0).value, outcome.replica(0).has_value = 42, True
            return outcome

    fresh = []

    def current(fresh_asked=False):
        fresh.append(fresh_asked)
        return Target()

    monkeypatch.setattr(targets, "current", lambda fresh=False: current(fresh))
    monkeypatch.setenv("COLAB_XLA_START_METHOD", "forkserver")
    monkeypatch.setenv("COLAB_XLA_VIEW", "text")
    result = ip.run_cell("%%xla_spawn --fresh -o got --env A=1\nprint('x')\nindex",
                         store_history=True)
    assert result.success, result.error_in_exec
    assert fresh == [True] and ran[0] == "refuse"
    asked = ran[1]
    assert (asked.env, asked.launch.one_off().start_method) == ({"A": "1"}, "forkserver")
    assert asked.cell.label.startswith("Cell In[") and asked.cell.source == "print('x')\nindex\n"
    assert ip.user_ns["got"] == {0: 42}
    assert [text for text in parses if text.startswith("# %%xla_spawn")] == [
        "# %%xla_spawn --fresh -o got --env A=1\nprint('x')\nindex\n"]


def test_the_magics_refusal_by_the_target_comes_before_anything_is_shown(ip, monkeypatch,
                                                                         no_targets, capsys):
    monkeypatch.setattr(cluster, "_current", a_cluster())
    result = ip.run_cell("%%xla_spawn -n 2 --no-widget\nindex")
    assert str(result.error_in_exec) == CLUSTER_REFUSAL.format("-n")
    assert capsys.readouterr().out == ""


# --- --targets: which of a session's replicas run a cell -----------------------------------


def test_targets_name_ordinals_ranges_and_host_replicas_by_global_ordinal():
    from colab_xla.notebook.chosen import parse

    layout = [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert parse("3, 0-1").ordinals(layout) == [0, 1, 3]
    assert parse("1:0-1,0").ordinals(layout) == [0, 2, 3]
    assert parse("0,0,0-0").ordinals(layout) == [0]  # (named twice: runs once)


@pytest.mark.parametrize("text, said", [
    ("", "name at least one replica"), (" , ", "name at least one replica"),
    ("x", "'x' is not a replica"), ("3-1", "'3-1' is not a replica"),
    ("-1", "'-1' is not a replica"), ("1:", "'1:' is not a replica"),
])
def test_targets_that_are_not_replicas_are_refused_with_an_example(text, said):
    from colab_xla.notebook.chosen import parse

    with pytest.raises(OptionError, match=said) as info:
        parse(text)
    assert "--targets" in str(info.value)


def test_targets_beyond_the_session_say_which_replicas_it_has():
    from colab_xla.notebook.chosen import parse

    with pytest.raises(OptionError, match=r"no replica 2 \(this session's are 0-1\)"):
        parse("2").ordinals([(0, 0), (0, 1)])
    with pytest.raises(OptionError, match=r"no replica 1:2 .*hosts are 0, 1"):
        parse("1:2").ordinals([(0, 0), (1, 0)])


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0.0, -1.0])
def test_run_cell_refuses_a_timeout_that_is_not_a_positive_number(timeout):
    from colab_xla.notebook.targets import run_cell

    with pytest.raises(ValueError, match=r"--timeout \S+: the timeout must be more than 0 "
                                         "seconds and finite"):
        run_cell("index", replicas=2, timeout=timeout)


# -- what a run imports before it forks ---------------------------------------------------------


@pytest.mark.parametrize("host", ["tpu", "cpu"])
def test_a_run_preloads_the_simulations_modules_only_for_a_simulation(monkeypatch, host):
    # One of them failing to import is skipped (the replicas say it); the launcher's is not.
    from colab_xla.errors import SetupError
    from colab_xla.notebook import hardware, preflight
    from colab_xla.runtimes import get

    runtime = get("torch_xla")
    detected = (hardware.Hardware(pjrt_device=None, tpu_chips=4, tpu_cores_per_chip=1)
                if host == "tpu" else hardware.Hardware(pjrt_device="CPU"))
    monkeypatch.setattr(hardware, "detect", lambda environ=None: detected)
    monkeypatch.setattr(preflight, "check", lambda *args: {"fatal": [], "notes": []})
    imported, failing = [], {runtime.simulation_preloads[0]}

    def stand_in(name):
        if name in failing:
            raise ImportError(f"no module named {name}")
        imported.append(name)

    monkeypatch.setattr(torch_xla_import, "_import", stand_in)

    def plan():
        return one_off.planned(None, replicas=4, launch=Launch(runtime=runtime), env={},
                               simulate=None, pull_from=None, defaults=Defaults.read({}))

    assert (plan()[0].simulation is None) == (host == "tpu")
    simulated = list(runtime.simulation_preloads[1:]) if host == "cpu" else []
    assert imported == list(runtime.preloads) + simulated
    failing.add(runtime.preloads[0])
    with pytest.raises(SetupError, match=f"{runtime.preloads[0]} is installed but cannot"):
        plan()


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_a_session_finds_what_its_replicas_inherit_only_when_they_fork(tmp_path, monkeypatch,
                                                                       start_method):
    session = a_session(tmp_path, launch=Launch(start_method=start_method))
    inherited = []
    real = session_target.inherit
    monkeypatch.setattr(session_target, "inherit",
                        lambda *args: inherited.append(args[0]) or real(*args))
    monkeypatch.setattr(Session, "_launch", lambda self, job: None)  # (no replica starts)
    monkeypatch.setattr(Session, "_wait_ready", lambda self: None)
    try:
        session._start(0, None, {})
    finally:
        session.pipes.close()
    assert inherited == ([session.id] if start_method == "fork" else [])
