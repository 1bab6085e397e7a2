"""Two real Unix users on one machine, for the tests of what another local user can reach.

The ``two_users`` fixture makes two fresh users, a *victim* and an *attacker*, and a mount
namespace in which both see a /tmp and a /dev/shm of their own (empty tmpfs, mode 1777 as
the real ones): the tests plant and probe names there without touching the machine's.
Everything else (processes, ports, /proc, the network) is the machine's, as on a shared
JupyterHub host. The users are removed, with their homes and processes, when the test ends.

It needs root (``useradd``, ``unshare``, ``nsenter``): run by another user, the layer says
so and skips. The checkout and its ``.venv`` must be reachable by the two users; a directory
on the way that others may not enter (``/root``, where pyenv's Pythons live here) is
replaced, in the namespace only, by one that shows just the path needed.

Example::

    def test_neighbour_cannot_read(two_users):     # the fixture is tests/conftest.py's
        m = two_users
        m.python(m.victim, "import os; os.close(os.open('/tmp/mine', os.O_CREAT, 0o600))")
        assert m.python(m.attacker, "open('/tmp/mine')", check=False).returncode != 0
        book = m.notebook(m.victim)                      # colab_xla loaded in IPython
        assert book.run("%%xla_spawn -n 2 -o outs\nindex", then="outs")["value"] == {
            "0": 0, "1": 1}
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
SHM_SIZE = "2g"  # the namespace's /dev/shm

# Run as root in the new namespace: mount the private /tmp and /dev/shm, make the needed
# paths reachable, say "ready", then hold the namespace until stdin closes.
_HOLDER = r"""
import ctypes, os, stat, subprocess, sys

libc = ctypes.CDLL(None, use_errno=True)
MS_BIND, MS_REC = 4096, 16384
SHM_SIZE, needed = sys.argv[1], sys.argv[2:]
kept = {}  # an overmounted directory -> a descriptor of what was there before

def run(*args, **kw):
    subprocess.run(args, check=True, **kw)

def overmount(path, mode, size=""):
    kept[path] = os.open(path, os.O_PATH | os.O_DIRECTORY)
    run("mount", "-t", "tmpfs", "-o", f"mode={mode:o}{size}", "colab_xla-test", path)

def show(path):
    # The overmounted directory under which `path` lies, if any: recreate the way down
    # (root's, 0755) and bind what was there.
    for top, fd in sorted(kept.items(), key=lambda kv: -len(kv[0])):
        if path == top or not path.startswith(top.rstrip("/") + "/"):
            continue
        rel = os.path.relpath(path, top)
        if os.path.exists(path):
            return
        os.makedirs(path, 0o755, exist_ok=True)
        # (mount(2) itself: mount(8) would resolve the descriptor's name, now overmounted)
        source = f"/proc/self/fd/{fd}/{rel}".encode()
        if libc.mount(source, path.encode(), None, MS_BIND | MS_REC, None) != 0:
            raise OSError(ctypes.get_errno(), f"bind {rel} of {top} on {path}")
        return

overmount("/tmp", 0o1777)
overmount("/dev/shm", 0o1777, f",size={SHM_SIZE}")  # (small enough for a test to fill)
for path in needed:
    show(path)
for _ in range(8):  # a locked directory on the way (each pass unlocks the topmost one left)
    locked = []
    for p in needed:
        parts = p.strip("/").split("/")
        for i in range(1, len(parts)):
            a = "/" + "/".join(parts[:i])
            if not os.stat(a).st_mode & stat.S_IXOTH:
                locked.append(a)
                break
    if not locked:
        break
    overmount(locked[0], 0o755)
    for path in needed:
        show(path)
print("ready", flush=True)
sys.stdin.read()
"""


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str


# The victim's notebook: an IPython shell with colab_xla loaded that runs the cells it is
# sent, one JSON line each ({"cell": ..., "then": an expression to give back}), and answers
# each with a JSON line: its pid first.
NOTEBOOK = r"""
import contextlib, io, json, os, sys
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
ip.run_line_magic("load_ext", "colab_xla")
print(json.dumps({"pid": os.getpid()}), flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = ip.run_cell(ask["cell"])
        value = eval(ask["then"], ip.user_ns) if ask.get("then") and result.success else None
    print(json.dumps({"ok": result.success, "out": out.getvalue(), "err": err.getvalue(),
                      "error": repr(result.error_in_exec or result.error_before_exec),
                      "value": value}), flush=True)
"""


class Notebook:
    """A notebook process of one of the users (see NOTEBOOK): ``run(cell, then)`` runs a
    cell and gives back what it printed, whether it succeeded, and the value of ``then``
    (an expression, in the notebook's names) as JSON."""

    def __init__(self, machine, user):
        self.proc = machine.popen(user, NOTEBOOK)
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the notebook did not start: {self.proc.stderr.read()}")
        self.pid = json.loads(line)["pid"]

    def run(self, cell: str, then: str = "") -> dict:
        self.proc.stdin.write(json.dumps({"cell": textwrap.dedent(cell).lstrip("\n"),
                                           "then": then}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the notebook ended: {self.proc.stderr.read()}")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(60)


class SharedMachine:
    """Two users and the namespace they share; see the module's docstring."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.victim = _add_user(f"cxv{tag}")
        self.attacker = _add_user(f"cxa{tag}")
        self._holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--",
             sys.executable, "-c", _HOLDER, SHM_SIZE, *_needed_paths()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self._holder.stdout.readline()
        if line.strip() != "ready":
            err = self._holder.communicate(timeout=10)[1]
            self.close()
            raise RuntimeError(f"the test namespace did not start: {line!r} {err}")
        self._started: List[subprocess.Popen] = []

    def command(self, user: Optional[User], argv: List[str]) -> List[str]:
        """``argv`` as ``user`` (root where None) in the namespace."""
        prefix = ["nsenter", "-t", str(self._holder.pid), "-m", "--"]
        if user is None:
            return prefix + argv
        return prefix + ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}",
                         "--init-groups", "--"] + argv

    def environ(self, user: Optional[User], extra: Optional[Dict[str, str]] = None):
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
               "HOME": user.home if user else "/root",
               "USER": user.name if user else "root",
               "LANG": "C.UTF-8",
               "PYTHONPATH": str(ROOT),
               "PJRT_DEVICE": "CPU"}
        env.update(extra or {})
        return env

    def python(self, user: Optional[User], code: str, *, timeout: float = 120,
               env: Optional[Dict[str, str]] = None, check: bool = True
               ) -> subprocess.CompletedProcess:
        """Run ``code`` in ``.venv``'s Python as ``user``; its output as text."""
        done = subprocess.run(
            self.command(user, [sys.executable, "-c", textwrap.dedent(code)]),
            env=self.environ(user, env), cwd="/", capture_output=True, text=True,
            timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"as {user.name if user else 'root'}: exit "
                                 f"{done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def popen(self, user: Optional[User], code: str, *,
              env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        """Start ``code`` as ``user``, its pipes as text; killed at the fixture's end if
        still running."""
        proc = subprocess.Popen(
            self.command(user, [sys.executable, "-c", textwrap.dedent(code)]),
            env=self.environ(user, env), cwd="/", stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._started.append(proc)
        return proc

    def notebook(self, user: User) -> "Notebook":
        """A notebook process of ``user``'s, with colab_xla loaded."""
        return Notebook(self, user)

    def close(self) -> None:
        for proc in getattr(self, "_started", ()):
            if proc.poll() is None:
                with _suppress():
                    os.killpg(proc.pid, 9)  # its own session: exactly what it started
                proc.wait(10)
        for user in (getattr(self, "victim", None), getattr(self, "attacker", None)):
            if user is not None:
                _kill_users_processes(user)
        holder = getattr(self, "_holder", None)
        if holder is not None and holder.poll() is None:
            holder.stdin.close()
            holder.wait(10)
        for user in (getattr(self, "victim", None), getattr(self, "attacker", None)):
            if user is not None:
                subprocess.run(["userdel", "-r", user.name], capture_output=True)


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


def _add_user(name: str) -> User:
    subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    return User(name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def _kill_users_processes(user: User) -> None:
    """Every process of a user this fixture made (by uid, which no one else has)."""
    import psutil

    for proc in psutil.process_iter(["uids"]):
        with _suppress():
            if proc.info["uids"] and proc.info["uids"].real == user.uid:
                proc.kill()


def _needed_paths() -> List[str]:
    """What the users' Python needs to reach: the checkout, the venv and its base Python."""
    base = Path(os.path.realpath(sys.executable)).parents[1]
    return sorted({str(ROOT), str(Path(sys.prefix)), str(base)})


def why_not() -> Optional[str]:
    """Why the layer cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (it adds two Unix users and a mount namespace); run as root"
    missing = [t for t in ("useradd", "userdel", "unshare", "nsenter", "setpriv")
               if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux, passwd)"
    return None
