"""The magic's options (colab_xla.notebook.options): the line split as a shell would, --env,
--pull, -o, --cache and the checks of a run's options; the options each action of
%xla_session and %xla_cluster takes; and the start methods, launchers and
environments of colab_xla.notebook.launch that they give."""

import os

import pytest

from colab_xla.errors import OptionError
from colab_xla.notebook import launch
from colab_xla.notebook.options import (LineError, check_cluster_line, check_run,
                                        check_session_line, parse_env, split_line)

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def check_options(env, pull, pull_from, replicas=None, timeout=None, cache_dir=None,
                  how=launch.Launch()):
    return check_run(replicas=replicas, timeout=timeout, env=env, pull=pull, pull_from=pull_from,
                     cache_dir=cache_dir, launch=how)


@pytest.mark.parametrize("items, expected", [
    (["XLA_IR_DEBUG=1"], {"XLA_IR_DEBUG": "1"}),
    (["XLA_FLAGS=--a=1 --b=2", "EMPTY="], {"XLA_FLAGS": "--a=1 --b=2", "EMPTY": ""}),
])
def test_env_assignments_are_parsed_at_the_first_equals_sign(items, expected):
    assert parse_env(items) == expected


@pytest.mark.parametrize("bad", ["NOEQUALS", "=value"])
def test_env_assignments_without_a_key_are_refused(bad):
    with pytest.raises(OptionError, match="KEY=VALUE"):
        parse_env([bad])


@pytest.mark.parametrize("kwargs, match", [
    ({"env": {"1ABC": "x"}}, "--env 1ABC=x"),
    ({"pull": ["not a name"]}, "--pull not a name"),
    ({"pull": ["x"], "pull_from": -1}, "--pull-from -1"),
    ({"pull_from": 0}, "together with --pull"),
])
def test_bad_options_are_refused_with_the_option_named(kwargs, match):
    args = {"env": {}, "pull": (), "pull_from": None, **kwargs}
    with pytest.raises(OptionError, match=match):
        check_options(**args)


@pytest.mark.parametrize("line, argv", [
    ('--env XLA_FLAGS="--xla_a --xla_b=1" -n 2',
     ["--env", "XLA_FLAGS=--xla_a --xla_b=1", "-n", "2"]),
    ("--env 'A=x y'", ["--env", "A=x y"]),
    ("--env A=it\\'s --env B='\"q\"'", ["--env", "A=it's", "--env", 'B="q"']),
    ("--env A=#1 --cache ''", ["--env", "A=#1", "--cache", ""]),  # "#" is text; '' is empty
    ("  ", []),
])
def test_the_line_is_split_as_a_shell_would(line, argv):
    assert split_line(line) == argv


@pytest.mark.parametrize("line, where", [
    ('--env A="x y', 'the " at column 9 opens a quoted value that is never closed'),
    ('-n 2 --env A="x \\" y', 'the " at column 14 opens a quoted value'),  # \" is no end
    ("-n 2 --env A='x' -o 'it", "the ' at column 21 opens a quoted value"),
    ("-o out\\", "the line ends with a backslash"),
])
def test_an_unsplittable_line_says_what_is_wrong_and_what_to_do(line, where):
    with pytest.raises(LineError) as info:
        split_line(line)
    assert str(info.value).startswith(f"%%xla_spawn {line}: {where}")
    assert "Close it" in str(info.value) or "Remove it" in str(info.value)


def test_pull_names_keep_their_order_once_each_and_an_empty_pull_is_refused():
    from colab_xla.notebook.options import pull_names

    assert pull_names(["model,losses", " model ", "a,a"]) == ["model", "losses", "a"]
    for empty in ("", " , "):
        with pytest.raises(ValueError, match="give one NAME or more"):
            pull_names([empty])


@pytest.mark.parametrize("name, pull, match", [
    ("class", [], "-o class: NAME must be a Python identifier"),
    ("", [], "-o '': NAME must be a Python identifier"),
    ("model", ["model"], "-o model and --pull model would both store into the notebook's model"),
])
def test_output_names_the_notebook_cannot_use_or_that_pull_overwrites_are_refused(name, pull,
                                                                                  match):
    from colab_xla.notebook.options import check_output

    with pytest.raises(ValueError, match=match):
        check_output(name, pull)


def test_an_env_key_given_twice_with_two_values_is_refused_and_the_same_twice_is_fine():
    assert parse_env(["A=1", "A=1"]) == {"A": "1"}
    with pytest.raises(OptionError, match=r"--env A=1 and --env 'A=x y' set A twice: keep one"):
        parse_env(["A=1", "A=x y"])


def test_a_pull_of_a_keyword_is_refused():
    with pytest.raises(OptionError, match="--pull for: each NAME must be a Python identifier"):
        check_options({}, ["for"], None)


def test_an_empty_cache_directory_is_refused_not_taken_for_the_working_directory(tmp_path,
                                                                                 monkeypatch):
    from colab_xla.notebook.options import _cache_dir

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--cache '': give a directory"):
        _cache_dir("")


# -- how replicas start (colab_xla.notebook.launch) --------------------------------------------


def test_unknown_start_methods_and_launchers_are_refused():
    with pytest.raises(OptionError, match="fork, spawn, forkserver"):
        launch.Launch("thread")
    with pytest.raises(OptionError, match="--launcher torchrun"):
        launch.Launch(launcher="torchrun")


def test_replica_environment_is_the_base_with_changes_and_removals():
    env = launch.replica_environ({"A": "1", "B": None}, base={"B": "x", "C": "y"})
    assert env == {"A": "1", "C": "y"}


def test_environ_sets_and_restores_variables(monkeypatch):
    monkeypatch.setenv("COLAB_XLA_T1", "before")
    monkeypatch.delenv("COLAB_XLA_T2", raising=False)
    with launch.environ({"COLAB_XLA_T1": None, "COLAB_XLA_T2": "during"}):
        assert "COLAB_XLA_T1" not in os.environ and os.environ["COLAB_XLA_T2"] == "during"
    assert os.environ["COLAB_XLA_T1"] == "before" and "COLAB_XLA_T2" not in os.environ


@pytest.mark.parametrize("action, given, switch, auto, said", [
    ("status", ["-n", "--env"], None, False,
     "%xla_session status takes no -n, --env: options are given to %xla_session start."),
    ("restart", ["--runtime"], None, True,
     "%xla_session restart takes no --runtime: options are given to %xla_session start."),
    ("stop", [], "off", False, "%xla_session stop off: on and off are for %xla_session auto."),
    ("auto", [], "on", True, "%xla_session auto --auto: --auto is for %xla_session start (or "
                             "restart); %xla_session auto turns it on."),
])
def test_each_session_action_takes_its_own_options(action, given, switch, auto, said):
    with pytest.raises(OptionError) as info:
        check_session_line(action, given, switch, auto)
    assert str(info.value) == said
    check_session_line("start", given, None, True)
    check_session_line("restart", [], None, True)
    check_session_line("auto", [], switch, False)


@pytest.mark.parametrize("action, given, said", [
    ("stop", dict(hosts=2, replicas=2), "%xla_cluster stop takes no --hosts, -n: those are for "
                                        "%xla_cluster connect."),
    ("status", dict(address="ray://head:10001"), "%xla_cluster status takes no ADDRESS: those "
                                                 "are for %xla_cluster connect."),
    ("local", dict(hosts=2, replicas=2, slice_name="s"),
     "%xla_cluster local takes no --slice: those are for %xla_cluster connect (local takes "
     "--hosts, -n and --slices)."),
    ("local", dict(hosts=0, replicas=2), "--hosts 0: give 1 or more."),
    ("connect", dict(replicas=0), "-n 0: give 1 or more."),
    ("local", dict(hosts=2, replicas=2, slices=0), "--slices 0: give 1 or more."),
])
def test_each_cluster_action_takes_its_own_options(action, given, said):
    with pytest.raises(OptionError) as info:
        check_cluster_line(action, **given)
    assert str(info.value) == said
    check_cluster_line("connect", address="ray://head:10001", slice_name="s")
    check_cluster_line("local", hosts=2, replicas=2, slices=2)
    check_cluster_line("status")
