"""``%%xla_spawn`` through a real IPython InteractiveShell."""

import re
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from colab_xla.notebook.outcome import XlaSpawnError

from _shell import get_ipython, ip_fixture  # tests/ is on sys.path


pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]

ip = ip_fixture(scope="module", after=lambda shell: shell.run_line_magic("unload_ext", "colab_xla"))


def cell(ip, line, body):
    """Run a %%xla_spawn cell as a notebook would; return IPython's ExecutionResult."""
    return ip.run_cell(f"%%xla_spawn {line}\n{body}", store_history=True)


def test_load_registers_and_unload_removes_the_magic():
    shell = get_ipython()
    shell.run_line_magic("load_ext", "colab_xla")
    assert "xla_spawn" in shell.magics_manager.magics["cell"]
    shell.run_line_magic("unload_ext", "colab_xla")
    assert "xla_spawn" not in shell.magics_manager.magics["cell"]
    assert shell.run_cell("%%xla_spawn\n1").error_in_exec is not None  # really gone
    shell.run_line_magic("load_ext", "colab_xla")
    assert "xla_spawn" in shell.magics_manager.magics["cell"]


def test_help_is_generated_from_the_arguments(ip, capsys):
    ip.run_cell("%%xla_spawn?")
    out = capsys.readouterr().out
    assert "%xla_spawn [-n N] [-o NAME]" in out
    assert "-n N, --replicas N, --nprocs N" in out and "-o NAME, --output NAME" in out
    assert "index" in out and "device" in out and "lock" in out
    for option in ("--pull NAME[,NAME...]", "--pull-from ORDINAL", "--start-method",
                   "--launcher", "--debug-single", "--env KEY=VALUE", "--cache DIR",
                   "--simulate {processes,threads}"):
        assert option in out
    words = " ".join(out.split())  # argparse wraps the help
    assert "simulated replicas (1 to 128" in words and "quote a value with spaces" in words
    assert "one process per replica, as on TPU v4 and later" in words


@pytest.mark.parametrize("typed, page", [
    ("%%xla_spawn", "xla_spawn.md"), ("%xla_session", "sessions.md"),
    ("%xla_cluster", "clusters.md"), ("%xla_debug", "sessions.md"),
    ("%xla_doctor", "troubleshooting.md"), ("%%xla_local", "sessions.md")])
def test_each_magics_help_is_a_usage_line_a_summary_an_example_then_options(
        ip, capsys, typed, page):
    """As IPython's own %%script? and %timeit?: what a notebook shows is plain text (no
    reST), short, the magic's name as typed; the long explanations are in docs/."""
    ip.run_cell(f"{typed}?")
    out = capsys.readouterr().out
    help_text = out.split("Docstring:", 1)[1].split("\nFile:", 1)[0].strip("\n")
    lines = help_text.splitlines()
    assert lines[0].startswith(f"Usage: {typed}") and not lines[0].startswith(f"Usage: {typed}_")
    prose = help_text.split("\n\n", 1)[1]  # after the usage (argparse wraps it)
    prose = prose.split("\noptions:", 1)[0].split("\npositional arguments:", 1)[0]
    assert "Example:" in prose and typed in prose.split("Example:", 1)[1]
    assert len([line for line in prose.splitlines() if line.strip()]) <= 12, prose
    assert "``" not in help_text and "::" not in help_text, help_text
    assert lines[-1] == f"Docs: docs/{page} in colab_xla's repository."
    assert (Path(__file__).resolve().parents[1] / "docs" / page).is_file()


@pytest.mark.parametrize("line, message", [
    ("--bogus", "unrecognized arguments: --bogus"),
    ("-n many", "invalid int value: 'many'"),
    ("-o 2fast", "NAME must be a Python identifier"),
    ("--start-method thread", "argument --start-method: invalid choice: 'thread'"),
    ("--launcher torchrun", "argument --launcher: invalid choice: 'torchrun'"),
    ("--simulate fibers", "argument --simulate: invalid choice: 'fibers'"),
    ("--env NOVALUE", "--env NOVALUE: write KEY=VALUE"),
    ("--pull a-b", "--pull a-b: each NAME must be a Python identifier"),
    ("--pull-from 0", "together with --pull NAME"),
    ("-o class", "-o class: NAME must be a Python identifier (not a keyword)"),
    ("-o ''", "-o '': NAME must be a Python identifier"),
    ("-o m --pull m", "-o m and --pull m would both store into the notebook's m"),
    ("--pull ''", "--pull '': give one NAME or more"),
    ("--pull for", "--pull for: each NAME must be a Python identifier (not a keyword)"),
    ("--env A=1 --env A=2", "--env A=1 and --env A=2 set A twice: keep one"),
    ("--cache ''", "--cache '': give a directory"),
])
def test_bad_arguments_are_usage_errors(ip, capsys, line, message):
    result = cell(ip, line, "index")
    assert isinstance(result.error_in_exec, UsageError)
    assert message in str(result.error_in_exec) + capsys.readouterr().err


class _Called(Exception):
    """The request the magic ran on a one-off run (raised by a stand-in, so nothing starts)."""


@pytest.fixture
def run_cell_args(monkeypatch):
    from colab_xla.notebook.targets.one_off import OneOff

    def stand_in(self, request, observer=None):
        raise _Called(request)

    monkeypatch.setattr(OneOff, "run", stand_in)
    return lambda result: result.error_in_exec.args[0]


@pytest.mark.parametrize("line, env", [
    ('--env XLA_FLAGS="--xla_a --xla_b=1"', {"XLA_FLAGS": "--xla_a --xla_b=1"}),
    ("--env 'XLA_FLAGS=--xla_a --xla_b=1' --env B=''", {"XLA_FLAGS": "--xla_a --xla_b=1", "B": ""}),
    ('--env="A=it\'s a value"', {"A": "it's a value"}),
])
def test_quoted_values_arrive_as_a_shell_would_pass_them(ip, run_cell_args, line, env):
    request = run_cell_args(cell(ip, line, "index"))
    assert request.env == env


def test_every_option_takes_quoted_values(ip, run_cell_args, tmp_path):
    request = run_cell_args(cell(
        ip, f"-n '3' -o \"res\" --pull 'a, b' --cache '{tmp_path}/my cache'", "index"))
    assert (request.replicas, request.pull, request.cache_dir) == (
        3, ("a", "b"), f"{tmp_path}/my cache")


def test_a_notebook_variable_in_quotes_keeps_its_spaces(ip, run_cell_args):
    ip.user_ns["flags"] = "--xla_a --xla_b=1"
    request = run_cell_args(cell(ip, '--env XLA_FLAGS="$flags"', "index"))  # IPython expands $flags
    assert request.env == {"XLA_FLAGS": "--xla_a --xla_b=1"}


@pytest.mark.parametrize("line, message", [
    ('--env XLA_FLAGS="--xla_a', 'the " at column 17 opens a quoted value that is never closed'),
    ("-o it's", "the ' at column 6 opens a quoted value that is never closed"),
    ("-n 2 \\", "the line ends with a backslash"),
])
def test_an_unclosed_quote_is_a_usage_error_that_says_where(ip, run_cell_args, line, message):
    result = cell(ip, line, "index")
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    assert f"%%xla_spawn {line}: {message}" in str(result.error_in_exec)


def test_doctor_line_is_split_the_same_way(ip):
    with pytest.raises(UsageError, match="never closed"):
        ip.run_line_magic("xla_doctor", "'--kill-leftovers")


def test_empty_cell_is_a_usage_error_that_says_what_to_do(ip):
    result = cell(ip, "-n 2", "\n   \n")
    assert isinstance(result.error_in_exec, UsageError)
    assert "write the code every replica runs" in str(result.error_in_exec)


def test_syntax_error_is_reported_with_the_cells_line_before_anything_runs(ip, capsys):
    result = cell(ip, "-n 2", "x = 1\nif x\n    pass")
    assert isinstance(result.error_in_exec, SyntaxError)
    assert result.error_in_exec.lineno == 3  # the notebook's line 3: "if x"
    assert "replica" not in capsys.readouterr().out  # nothing was spawned


@pytest.mark.xla
def test_replica_count_the_hardware_cannot_honour_is_a_usage_error(ip):
    result = cell(ip, "-n 0", "index")
    assert isinstance(result.error_in_exec, UsageError) and "1 or more" in str(result.error_in_exec)


@pytest.mark.xla
@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_cpu_num_devices_that_is_not_a_count_is_a_usage_error_naming_it(ip, capsys,
                                                                           monkeypatch, value):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", value)
    result = cell(ip, "", "index")
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    assert f"CPU_NUM_DEVICES='{value}': the number of replicas" in str(result.error_in_exec)
    assert "[replica" not in capsys.readouterr().out  # nothing started
    monkeypatch.delenv("CPU_NUM_DEVICES")
    result = cell(ip, f"--env CPU_NUM_DEVICES={value}", "index")  # the replicas' own: the same
    assert f"CPU_NUM_DEVICES='{value}'" in str(result.error_in_exec)


@pytest.mark.xla
@pytest.mark.timeout(120)
def test_results_and_output_come_back_to_the_notebook(ip, capsys):
    ip.run_cell("SCALE = 3\ndef scaled(i):\n    return i * SCALE")
    result = cell(ip, "-n 4 -o res", "print('hello from', index)\nscaled(index)")
    assert result.success, result.error_in_exec
    assert ip.user_ns["res"] == {0: 0, 1: 3, 2: 6, 3: 9}
    assert list(ip.user_ns["res"]) == [0, 1, 2, 3]
    out = capsys.readouterr().out  # a terminal shell has no widgets: the text view
    assert "4 replicas on CPU: 4 done" in out
    for o in range(4):
        assert f"[replica {o}] hello from {o}\n" in out  # streamed as it came
        assert re.search(rf"── replica {o} · done · [0-9.]+ s\nOut: {3 * o}\n", out)  # summary


@pytest.mark.xla
@pytest.mark.timeout(120)
def test_a_failing_replica_raises_one_grouped_error_and_keeps_the_other_results(ip, capsys):
    number = ip.execution_count  # this cell's In[number]
    result = cell(ip, "-n 4 -o partial",
                  "if index in (1, 3):\n    raise KeyError(index % 2)\nindex")
    error = result.error_in_exec
    assert isinstance(error, XlaSpawnError)
    assert error.outcome.failed == [1, 3]
    rendered = "\n".join(error._render_traceback_())
    assert "[replicas 1, 3]" in rendered and rendered.count("Traceback") == 1
    assert f"Cell In[{number}], line 3, in <module>" in rendered
    assert ip.user_ns["partial"] == {0: 0, 2: 2}  # nothing lost
    assert "[replicas 1, 3]" in capsys.readouterr().out  # IPython drew our traceback


@pytest.mark.parametrize("line", ["-t 0", "--timeout -5", "-t nan", "-t inf", "-t 1e400"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_before_anything_runs(ip, capsys,
                                                                                  line):
    result = cell(ip, line, "index")  # nan and inf meant no timeout at all
    assert isinstance(result.error_in_exec, UsageError)
    assert "must be more than 0 seconds and finite; leave -t out" in str(result.error_in_exec)
    assert "replica" not in capsys.readouterr().out  # nothing announced, nothing started


@pytest.mark.xla
@pytest.mark.timeout(180)
def test_a_model_trained_in_the_replicas_is_in_the_notebook_in_one_line(ip):
    ip.run_cell("import torch\nclass Net(torch.nn.Module):\n"
                "    def __init__(self):\n        super().__init__()\n"
                "        self.fc = torch.nn.Linear(2, 1)\n")
    body = ("import torch\nmodel = Net().to(device)\n"
            "with torch.no_grad():\n    model.fc.bias.fill_(index + 0.5)\n"
            "losses = [1.0, 0.5]")
    result = cell(ip, "-n 3 --pull model --pull-from 2 --pull losses", body)
    assert result.success, result.error_in_exec
    model = ip.user_ns["model"]
    assert type(model) is ip.user_ns["Net"]  # the notebook's own class
    assert model.fc.bias.device.type == "cpu" and model.fc.bias.item() == 2.5
    assert ip.user_ns["losses"] == [1.0, 0.5]  # --pull-from: plain values, not a dict
    result = cell(ip, "-n 2 --pull model,losses --start-method forkserver", body)
    assert result.success, result.error_in_exec
    assert sorted(ip.user_ns["model"]) == [0, 1]
    assert ip.user_ns["losses"] == {0: [1.0, 0.5], 1: [1.0, 0.5]}
    assert type(ip.user_ns["model"][1]) is ip.user_ns["Net"]  # sent by value, back as itself
    assert ip.user_ns["model"][1].fc.bias.item() == 1.5


@pytest.mark.xla
@pytest.mark.timeout(120)
def test_pull_from_a_replica_that_does_not_exist_is_refused_before_anything_runs(ip, capsys):
    result = cell(ip, "-n 2 --pull x --pull-from 5", "x = 1")
    assert isinstance(result.error_in_exec, UsageError)
    assert "--pull-from 5: this run has 2 replicas (0-1)" in str(result.error_in_exec)
    assert "[replica" not in capsys.readouterr().out


@pytest.mark.xla
@pytest.mark.timeout(120)
def test_an_unsendable_name_is_a_usage_error_naming_it(ip):
    ip.run_cell("import threading\nguard = threading.Lock()")
    result = cell(ip, "-n 2 --start-method forkserver", "with guard:\n    index")
    assert isinstance(result.error_in_exec, UsageError)
    assert "guard (lock)" in str(result.error_in_exec)
    assert "--start-method fork" in str(result.error_in_exec)


@pytest.mark.xla
@pytest.mark.timeout(120)
def test_default_start_method_comes_from_the_environment(ip, monkeypatch):
    ip.run_cell("import threading\nguard = threading.Lock()")
    monkeypatch.setenv("COLAB_XLA_START_METHOD", "forkserver")
    result = cell(ip, "-n 2", "with guard:\n    index")
    assert isinstance(result.error_in_exec, UsageError)
    assert "forkserver" in str(result.error_in_exec)
    monkeypatch.setenv("COLAB_XLA_START_METHOD", "spoon")
    result = cell(ip, "-n 2", "index")
    assert isinstance(result.error_in_exec, UsageError)
    assert "--start-method spoon" in str(result.error_in_exec)


def test_loading_with_forkserver_as_default_starts_the_server_at_once(monkeypatch):
    from colab_xla.notebook import launch

    started = []
    monkeypatch.setattr(launch, "warm_forkserver", lambda: started.append(True) or (1, True))
    shell = get_ipython()
    shell.run_line_magic("unload_ext", "colab_xla")
    monkeypatch.setenv("COLAB_XLA_START_METHOD", "fork")
    shell.run_line_magic("load_ext", "colab_xla")
    assert started == []
    shell.run_line_magic("unload_ext", "colab_xla")
    monkeypatch.setenv("COLAB_XLA_START_METHOD", "forkserver")
    shell.run_line_magic("load_ext", "colab_xla")
    assert started == [True]


@pytest.mark.xla
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook", ["opened", "tick", "closed"])
def test_a_view_that_fails_costs_no_result_and_the_text_view_takes_over(ip, capsys, monkeypatch,
                                                                       hook):
    from colab_xla.notebook import views
    from colab_xla.notebook.outcome import RunObserver

    class Broken(RunObserver):
        pass

    def fail(*args):
        raise AttributeError("'VBox' object has no attribute '_repr_mimebundle_'")

    setattr(Broken, hook, fail)
    monkeypatch.setattr(views, "choose", lambda kind, has_kernel: views.FallbackView(Broken()))
    ip.user_ns.pop("kept", None)
    result = cell(ip, "-n 2 -o kept --pull doubled",
                  "import time\ndoubled = 2 * index\nprint('line of', index)\n"
                  "time.sleep(0.5)\nindex")  # long enough for a tick
    assert result.success, result.error_in_exec
    assert ip.user_ns["kept"] == {0: 0, 1: 1} and ip.user_ns["doubled"] == {0: 0, 1: 2}
    out = capsys.readouterr().out
    assert out.count("colab_xla: the Broken view failed (AttributeError: 'VBox' object has no "
                     "attribute '_repr_mimebundle_'); showing this run as text.") == 1
    assert "2 replicas on CPU: 2 done" in out
    assert "line of 1" in out and "Out: 1" in out  # the summary shows what the view did not


@pytest.mark.xla
@pytest.mark.timeout(120)
def test_a_timeout_shorter_than_the_start_up_says_timeout_not_done(ip, capsys):
    """The stop came before the pool had started the replicas: they ran on and reported
    `done` after it (issue #12). A report after the stop is not in time."""
    result = cell(ip, "-n 2 -t 0.001 -o late", "index")
    error = result.error_in_exec
    assert isinstance(error, XlaSpawnError), error
    assert error.outcome.ok is False and error.outcome.stopped == [0, 1]
    for rep in error.outcome.replicas.values():
        assert rep.error.kind == "timeout" and "--timeout 0.001 s" in rep.error.evalue
    assert ip.user_ns["late"] == {}
    out = capsys.readouterr().out
    assert "2 done" not in out and "2 of 2 replicas were stopped (Timeout)" in out, out


@pytest.mark.xla
@pytest.mark.timeout(120)
def test_a_failed_rerun_keeps_the_earlier_values_and_says_so(ip, capsys):
    assert cell(ip, "-n 2 -o kept_res --pull kept_x", "kept_x = index\nindex * 10").success
    assert ip.user_ns["kept_res"] == {0: 0, 1: 10} and ip.user_ns["kept_x"] == {0: 0, 1: 1}
    capsys.readouterr()
    result = cell(ip, "-n 2 -o kept_res --pull kept_x", "raise ValueError('every replica')")
    assert isinstance(result.error_in_exec, XlaSpawnError)
    assert ip.user_ns["kept_res"] == {0: 0, 1: 10} and ip.user_ns["kept_x"] == {0: 0, 1: 1}
    out = capsys.readouterr().out  # said in the headline, as one clause (issue 55)
    assert re.search(r"^2 replicas on CPU: 2 failed in \d+\.\d\d s · `-o kept_res`, "
                     r"`--pull kept_x` kept their earlier value$", out, re.M), out
    # New values arrived from the replica that did not fail: they replace the old ones.
    result = cell(ip, "-n 2 -o kept_res", "if index == 1:\n    raise ValueError('one')\n'new'")
    assert isinstance(result.error_in_exec, XlaSpawnError)
    assert ip.user_ns["kept_res"] == {0: "new"}
    out = capsys.readouterr().out
    assert "earlier value" not in out
    assert re.search(r"^2 replicas on CPU: 1 done, 1 failed in \d+\.\d\d s · results in "
                     r"`kept_res`$", out, re.M), out


def test_the_headline_says_where_o_put_the_results_and_nothing_without_o(ip, capsys):
    """Issue 55: ``-o shapes`` stored the results without a word."""
    capsys.readouterr()
    assert cell(ip, "-n 2 --no-widget -o said_res", "index").success
    assert cell(ip, "-n 2 --no-widget", "index").success
    out = capsys.readouterr().out
    assert re.findall(r"^2 replicas on CPU: 2 done in \d+\.\d\d s(.*)$", out, re.M) == [
        " · results in `said_res`", ""], out


def test_only_refusals_are_usage_errors_a_bug_keeps_its_type_and_traceback(ip, monkeypatch):
    # A ValueError from deep inside a run (a bug, not a refusal) must not be dressed up as
    # a UsageError, which IPython shows without its traceback.
    from colab_xla.errors import SetupError
    from colab_xla.notebook.targets.one_off import OneOff

    def buggy(self, request, observer=None):
        raise ValueError("a bug in colab_xla")

    monkeypatch.setattr(OneOff, "run", buggy)
    result = cell(ip, "-n 2 --no-widget", "index")
    assert type(result.error_in_exec) is ValueError, result.error_in_exec
    assert result.error_in_exec.__traceback__ is not None

    def refused(self, request, observer=None):
        raise SetupError("refused: do this instead")

    monkeypatch.setattr(OneOff, "run", refused)
    result = cell(ip, "-n 2 --no-widget", "index")
    assert isinstance(result.error_in_exec, UsageError)
    assert str(result.error_in_exec) == "refused: do this instead"



def test_the_headlines_time_is_the_wait_start_up_included_each_replicas_its_own(
        ip, monkeypatch, capsys):
    """Issue 55: a 3.4 s first cell said "done in 0.1 s": the headline counted from the
    replicas' start, not the planning before it (the notebook importing torch_xla to look
    for a TPU). The headline is the wait, from the magic's start; a replica's time is its
    own run, from the replicas' start."""
    from colab_xla.notebook.targets import one_off

    planning = []

    def slow_planned(*args, **kwargs):  # a start-up that takes a while (a cold import)
        began = time.monotonic()
        time.sleep(0.3)
        try:
            return real_planned(*args, **kwargs)
        finally:
            planning.append(time.monotonic() - began)

    real_planned = one_off.planned
    monkeypatch.setattr(one_off, "planned", slow_planned)
    capsys.readouterr()
    result = cell(ip, "-n 2 --no-widget", "index")
    assert result.error_in_exec is None, result.error_in_exec
    out = capsys.readouterr().out
    took = float(re.search(r"^2 replicas on CPU: 2 done in (\d+\.\d\d) s$", out, re.M)[1])
    replicas = [float(t) for t in re.findall(r"^── replica \d · done · (\d+\.\d\d) s$",
                                             out, re.M)]
    assert len(replicas) == 2 and len(planning) == 1, out
    # (the planning came before the replicas started: the wait holds both; .01 s: rounding)
    assert took + 0.01 >= planning[0] + max(replicas), out
    assert max(replicas) < took, out


# -- the body's IPython syntax ---------------------------------------------------------------

def test_ipython_syntax_in_a_multi_line_body_runs_on_the_replicas(ip):
    """A magic's line among Python lines (a real run of 1 replica)."""

    result = cell(ip, "-n 1 -o _said", "import os\n%env SAID=from-a-magic\n"
                  "os.environ['SAID'] + f'-in-{index}'")
    assert result.error_in_exec is None, result.error_in_exec
    assert ip.user_ns["_said"] == {0: "from-a-magic-in-0"}
