"""Auto mode's cell transformer (colab_xla.notebook.auto_cells)."""

import pytest

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


@pytest.fixture
def auto(monkeypatch):
    from colab_xla.notebook import auto_cells

    monkeypatch.setattr(auto_cells.state, "on", True)
    monkeypatch.setattr(auto_cells.state, "session_kept", lambda: True)
    return auto_cells


@pytest.mark.parametrize("cell, replicas", [
    ("x = 1\n", True), ("\n# note\n  \nx\n", True), ("!ls\n", True), ("%time f()\n", True),
    ("x?\n", True),
    ("%xla_session auto off\n", False), ("%%xla_spawn -n 2\nx\n", False),
    ("%%time\nx = 1\n", False), ("%%bash\nls\n", False), ("%%xla_local\nx\n", False),
    ("# only a comment\n", False), ("\n  \n", False),
])
def test_auto_mode_sends_plain_cells_to_the_replicas_and_leaves_magics_alone(auto, cell,
                                                                              replicas):
    lines = cell.splitlines(keepends=True)
    done = auto.transform(lines)
    assert done == (["%%xla_spawn\n", *lines] if replicas else lines)


def test_auto_mode_transforms_nothing_while_suspended_or_off(auto, monkeypatch):
    with auto.suspended():
        with auto.suspended():
            assert auto.transform(["x\n"]) == ["x\n"]
        assert auto.transform(["x\n"]) == ["x\n"]
    assert auto.transform(["x\n"]) == ["%%xla_spawn\n", "x\n"]
    monkeypatch.setattr(auto.state, "on", False)
    assert auto.transform(["x\n"]) == ["x\n"]


def test_the_magic_knows_the_cells_auto_mode_made_and_only_those(auto, monkeypatch):
    body = "x = 1\nx\n"
    assert auto.transform(body.splitlines(keepends=True))[0] == "%%xla_spawn\n"
    assert auto.made_here("", body)
    assert not auto.made_here("", body)  # (asked once)
    # A cell the person began with %%xla_spawn, after auto mode made one of the same body
    # (a frontend asks whether a cell is complete by transforming it, and may not run it).
    auto.transform(body.splitlines(keepends=True))
    auto.transform(["%%xla_spawn\n", *body.splitlines(keepends=True)])
    assert not auto.made_here("", body)
    auto.transform(body.splitlines(keepends=True))
    assert not auto.made_here("", "y = 2\n") and not auto.made_here("-n 2", body)
    auto.transform(body.splitlines(keepends=True))
    monkeypatch.setattr(auto.state, "on", False)
    auto.transform(body.splitlines(keepends=True))
    assert not auto.made_here("", body)


def test_auto_mode_ends_when_its_session_is_gone_and_says_so(auto, monkeypatch, capsys):
    monkeypatch.setattr(auto.state, "session_kept", lambda: False)
    assert auto.transform(["x\n"]) == ["x\n"]
    assert not auto.state.on
    assert "auto mode ended with the session" in capsys.readouterr().out
