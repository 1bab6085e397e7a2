"""colab_xla's per-user state (colab_xla.notebook.state): runs' log directories, the sweep
of gone notebooks' work."""

import os

import pytest

from colab_xla.notebook.outcome import RunOutcome

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_a_runs_log_directory_is_made_at_its_first_logged_line_and_the_last_ten_kept(
        private_state):
    from colab_xla.notebook import state

    quiet = RunOutcome(device_type="CPU", log_dir=state.next_log_dir())
    quiet.replica(0)
    assert not quiet.logged and not os.path.exists(quiet.log_dir)  # nothing printed: none
    dirs = []
    for i in range(state.KEEP_LOGS_OF_RUNS + 2):
        outcome = RunOutcome(device_type="CPU", log_dir=state.next_log_dir())
        assert outcome.replica(0).log.write("stdout", f"line {i}\n") == [f"line {i}"]
        outcome.replica(0).log.finish()
        assert outcome.logged
        dirs.append(outcome.log_dir)
    mine = os.path.dirname(dirs[0])
    assert sorted(os.listdir(mine)) == [os.path.basename(d)
                                        for d in dirs[-state.KEEP_LOGS_OF_RUNS:]]
    with open(os.path.join(dirs[-1], "replica-0.log")) as f:
        assert f.read() == f"line {len(dirs) - 1}\n"


def test_a_quiet_run_makes_no_log_directory_and_one_made_after_a_cleaner_removed_it(
        private_state):
    """next_log_dir makes nothing (a warm cell asks for a run's log directory and most never
    log a line); make_log_dir makes this notebook process's directory of logs when it is
    not there, its first log or after a cleaner of /tmp removed it."""
    import shutil

    from colab_xla.notebook import state

    first = state.next_log_dir()
    mine = os.path.dirname(first)
    assert not os.path.exists(mine)
    assert state.make_log_dir(first) == first and os.path.isdir(first)
    assert oct(os.stat(mine).st_mode & 0o777) == "0o700"
    shutil.rmtree(mine)
    later = state.next_log_dir()
    assert os.path.dirname(later) == mine and not os.path.exists(mine)
    assert state.make_log_dir(later) == later and os.listdir(mine) == [os.path.basename(later)]
    elsewhere = os.path.join(str(private_state), "no-such-dir", "run-00001")
    with pytest.raises(FileNotFoundError):  # (not a path of next_log_dir: not made)
        state.make_log_dir(elsewhere)


def test_the_sweep_of_gone_notebooks_work_leaves_what_is_not_a_notebooks_and_goes_on(
        private_state):
    """A notebook process's directory of work is swept of those of notebook processes that
    are gone; an entry there that names no notebook process (put there by something else)
    stopped every run and session with a ValueError. It is left as it is."""
    from colab_xla.notebook import state

    parent = state.subdir("work")
    gone = os.path.join(parent, "999999999-12.50")  # (no such pid)
    stray = [os.path.join(parent, name) for name in ("tmpxqao6qap", "session-1x0rih19")]
    for path in [gone, *stray]:
        os.mkdir(path)
    mine = state.own_dir("work")
    assert os.path.isdir(mine)
    assert not os.path.exists(gone)
    assert all(os.path.isdir(path) for path in stray)
    assert state.kernel_alive(state.kernel_key()) and not state.kernel_alive("999999999-12.50")
