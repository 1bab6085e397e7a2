"""What another local user can do to colab_xla's files: two real Unix users on one machine
(tests/_two_users.py), the attacker planting names in /tmp and /dev/shm before the victim's
runs and probing them during and after. Each attack must fail, and the victim's runs must
still work. (The services a run starts, Ray's, torch's and JAX's, have modules of their own:
tests/test_shared_machine_*.py.)
"""

from __future__ import annotations

import os

import pytest


pytestmark = [pytest.mark.shared_machine, pytest.mark.timeout(600)]

@pytest.fixture
def notebook(two_users):
    """The victim's notebook process."""
    book = two_users.notebook(two_users.victim)
    yield book
    book.close()


def test_pages_planted_in_dev_shm_are_neither_read_nor_followed(two_users, notebook):
    """The attacker guesses the victim's page directory for freed results (its name once
    held the notebook's pid), plants free pages there, one of them a link to a file of the
    victim's, and keeps a link of his own to the other: the victim's large results go
    neither to him nor through the link."""
    m, v = two_users, two_users.victim
    m.python(v, f"open('{v.home}/precious', 'w').write('the thesis')")
    m.python(m.attacker, f"""
        import os
        pages = "/dev/shm/colab_xla-{v.uid}-{notebook.pid}-pages"
        os.mkdir(pages); os.chmod(pages, 0o777)
        os.mkdir("/dev/shm/spy")
        size = 4 << 20
        os.symlink("{v.home}/precious", f"{{pages}}/free-{{size}}-0")
        for n in (1, 2):
            with open(f"{{pages}}/free-{{size}}-{{n}}", "wb") as f:
                f.write(b"\\xaa" * size)
            os.chmod(f"{{pages}}/free-{{size}}-{{n}}", 0o666)
            os.link(f"{{pages}}/free-{{size}}-{{n}}", f"/dev/shm/spy/{{n}}")
        """)
    for _ in range(2):  # the second run claims what the first freed, if it was planted
        ran = notebook.run("""
            %%xla_spawn -n 2 -o outs
            import torch
            torch.full((1 << 20,), 7.0 + index)
            """, then="{i: float(t.sum()) for i, t in outs.items()}")
        assert ran["ok"], ran
        assert ran["value"] == {"0": 7.0 * (1 << 20), "1": 8.0 * (1 << 20)}
        assert notebook.run("del outs")["ok"]  # its pages freed, for the next run
    seen = m.python(m.attacker, """
        import os
        for n in sorted(os.listdir("/dev/shm/spy")):
            data = open(f"/dev/shm/spy/{n}", "rb").read()
            print(n, len(data), set(data) == {0xaa})
        """).stdout.split("\n")
    assert seen[:2] == ["1 4194304 True", "2 4194304 True"], seen  # untouched: not his
    assert open(f"{v.home}/precious").read() == "the thesis"


def test_a_state_directory_another_user_made_first_is_not_used(two_users, notebook):
    """The attacker makes /tmp/colab_xla-<victim's uid> first, and names that look like the
    places colab_xla falls back to (one open to all, one a link to a private directory of
    the victim's): the victim's run works, says once where its state went, and that is a
    directory of the victim's own that the attacker cannot enter."""
    m, v = two_users, two_users.victim
    m.python(v, f"import os; os.mkdir('{v.home}/mine', 0o700)")
    m.python(m.attacker, f"""
        import os
        for name in ("colab_xla-{v.uid}", "colab_xla-{v.uid}-0"):
            os.mkdir(f"/tmp/{{name}}"); os.chmod(f"/tmp/{{name}}", 0o777)
        os.symlink("{v.home}/mine", "/tmp/colab_xla-{v.uid}-1")
        """)
    ran = [notebook.run("%%xla_spawn -n 2 -o outs\nindex * 10", then="outs") for _ in range(2)]
    assert [r["ok"] for r in ran] == [True, True], ran
    assert ran[0]["value"] == {"0": 0, "1": 10}
    said = [r["err"] for r in ran]
    assert f"/tmp/colab_xla-{v.uid} is not a private directory" in said[0] and not said[1]
    used = said[0].split("using ", 1)[1].split(" instead")[0]
    assert used.startswith(f"/tmp/colab_xla-{v.uid}-") and used not in (
        f"/tmp/colab_xla-{v.uid}-0", f"/tmp/colab_xla-{v.uid}-1")
    owner_mode = m.python(None, f"import os; i = os.lstat({used!r}); "
                                "print(i.st_uid, oct(i.st_mode))")
    assert owner_mode.stdout.split() == [str(v.uid), "0o40700"]
    assert os.listdir(f"{v.home}/mine") == []  # nothing went through the link
    probe = m.python(m.attacker, f"import os; os.listdir({used!r})", check=False)
    assert "PermissionError" in probe.stderr


def test_a_full_dev_shm_makes_a_session_cell_say_so_not_fail(two_users, notebook):
    """/dev/shm has no quota per user: the attacker fills it while the victim's session is
    up. The session's next cells still run (their modules go to the session's own
    directory), and it says so once."""
    m = two_users
    started = notebook.run("%xla_session start -n 2")
    assert started["ok"], started
    fill = m.python(m.attacker, """
        import os
        with open("/dev/shm/filler", "wb") as f:
            try:
                while True:
                    f.write(b"x" * (1 << 24))
                    f.flush()
            except OSError as exc:
                assert exc.errno == 28, exc
        """)
    try:
        ran = [notebook.run(f"%%xla_spawn -o outs\ndef f():\n    return index + {n}\nf()",
                            then="outs") for n in (1, 2)]
    finally:
        m.python(m.attacker, "import os; os.unlink('/dev/shm/filler')")
    assert fill.returncode == 0
    assert [r["ok"] for r in ran] == [True, True], ran
    assert [r["value"] for r in ran] == [{"0": 1, "1": 2}, {"0": 2, "1": 3}]
    notes = [r["out"] + r["err"] for r in ran]
    assert "is full: this session's cells are written to" in notes[0], notes[0]
    assert "is full" not in notes[1]
    assert notebook.run("%xla_session stop")["ok"]


def test_nothing_colab_xla_makes_is_open_to_other_users(two_users, notebook):
    """Every file, socket and directory of the victim's state directory and /dev/shm, while
    a session is up and after a one-off run that logged, is the victim's alone: defence in
    depth, for a TMPDIR that is not private."""
    m, v = two_users, two_users.victim
    assert notebook.run("%%xla_spawn -n 2\nwith lock:\n    print('hi', index)")["ok"]
    assert notebook.run("%xla_session start -n 2")["ok"]
    assert notebook.run("%%xla_spawn\nwith lock:\n    print(index)")["ok"]
    listing = m.python(None, f"""
        import os, stat
        tops = [f"/tmp/colab_xla-{v.uid}"] + [
            f"/dev/shm/{{n}}" for n in os.listdir("/dev/shm") if n.startswith("colab_xla-")]
        for top in tops:
            for d, dirs, files in os.walk(top):
                for name in [d] + [os.path.join(d, n) for n in dirs + files]:
                    info = os.lstat(name)
                    if not stat.S_ISLNK(info.st_mode):
                        print(oct(info.st_mode & 0o777), info.st_uid, name)
        """).stdout.splitlines()
    assert notebook.run("%xla_session stop")["ok"]
    seen = {line.split()[2].split("/")[3] for line in listing
            if line.split()[2].startswith(f"/tmp/colab_xla-{v.uid}/")}
    assert {"logs", "runs", "work"} <= seen, listing  # (the walk saw them)
    open_to_others = [line for line in listing if int(line.split()[0], 8) & 0o077
                      or int(line.split()[1]) != v.uid]
    assert open_to_others == [], open_to_others
