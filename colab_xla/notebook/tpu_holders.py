"""Who holds the TPU, found without initializing anything: the processes that have a TPU
device open, and the libtpu lock file with the process that locks it.

A TPU chip is opened by one process at a time (``/dev/accel*`` on v2-v4, the VFIO group
``/dev/vfio/<n>`` on v5e, v5p, v6e); and a libtpu that takes every chip of the host first
locks ``/tmp/libtpu_lockfile`` (``lockf``, a POSIX record lock held until its process
exits, the file removed at a normal exit). So JAX or TensorFlow used in the notebook's own
process, a leftover process, or a lock file that cannot be opened makes every replica fail
("The TPU is already in use by process with pid ...", or "open(/dev/vfio/0): Device or
resource busy").

Everything here reads ``/proc``: ``/proc/<pid>/fd`` links (a process whose files this user
cannot read is counted, not guessed at), ``/proc/<pid>/cmdline`` and ``status`` for who it
is, ``/proc/locks`` for the lock holder. Only when ``/proc/locks`` cannot be read is the
lock file probed, with ``F_GETLK``, which takes no lock; the file is opened read-only and
never created; a process that has it open already probes through that descriptor and
opens none (closing any descriptor of a file drops the POSIX locks its process holds on it).

Example::

    >>> found = scan(proc_root="/nonexistent", lockfile="/nonexistent/lock")
    >>> found.holders, fact(found)
    ((), 'nobody')
"""

from __future__ import annotations

import dataclasses
import fcntl
import fnmatch
import os
import pwd
import struct
import sys
from dataclasses import dataclass
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import Problem
from ..runtimes.plan import DEVICE_FILES

LOCKFILE = "/tmp/libtpu_lockfile"
DEV_GLOBS = DEVICE_FILES["TPU"]
# Modules whose use in the notebook's process takes the TPU (both preinstalled on Colab
# and Kaggle TPU runtimes).
TPU_USERS = ("jax", "jaxlib", "tensorflow")

_FLOCK = "hhqqi4x"  # struct flock on 64-bit Linux: type, whence, start, len, pid


@dataclass(frozen=True)
class Holder:
    """A process that has a TPU device open or locks the libtpu lock file."""

    pid: int  # 0: a process this notebook cannot see (another pid namespace)
    cmdline: str
    user: str
    devices: Tuple[str, ...] = ()
    locks_lockfile: bool = False
    own: bool = False  # this notebook's own process

    def holds(self) -> str:
        what = []
        if self.devices:
            what.append(f"has {', '.join(self.devices)} open")
        if self.locks_lockfile:
            what.append("locks the libtpu lock file")
        return " and ".join(what)


@dataclass(frozen=True)
class Scan:
    holders: Tuple[Holder, ...]
    unreadable: int  # processes whose open files this user cannot read
    lockfile: str
    lockfile_state: str  # "absent", "held", "stale" (nobody locks it) or "unknown"
    lockfile_owner: Optional[str] = None  # user owning the file, when it exists
    lockfile_openable: bool = True  # this user can open it read-write, as libtpu does


def _read(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def describe(pid: int, proc_root: str = "/proc") -> Tuple[str, str]:
    """Command line and user of a process ("?" for what cannot be read)."""
    raw = _read(f"{proc_root}/{pid}/cmdline")
    cmdline = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace") if raw else "?"
    user = "?"
    for line in (_read(f"{proc_root}/{pid}/status") or b"").decode(errors="replace").splitlines():
        if line.startswith("Uid:"):
            user = _user(int(line.split()[1]))
    return cmdline, user


def _pids(proc_root: str) -> List[int]:
    try:
        return sorted(int(name) for name in os.listdir(proc_root) if name.isdigit())
    except OSError:
        return []


def open_files(pid: int, proc_root: str = "/proc") -> Optional[List[Tuple[int, str]]]:
    """``(fd, target)`` of every open file of a process; None if it cannot be read."""
    fd_dir = f"{proc_root}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        return []  # gone meanwhile
    except OSError:
        return None  # another user's process
    found = []
    for name in names:
        try:
            found.append((int(name), os.readlink(f"{fd_dir}/{name}")))
        except (OSError, ValueError):
            continue  # closed meanwhile
    return found


def device_users(proc_root: str = "/proc", dev_globs: Sequence[str] = DEV_GLOBS
                 ) -> Tuple[Dict[int, Tuple[str, ...]], int]:
    """Processes with a TPU device open (pid: devices), and how many could not be read."""
    users, unreadable = {}, 0
    for pid in _pids(proc_root):
        files = open_files(pid, proc_root)
        if files is None:
            unreadable += 1
            continue
        devices = sorted({t for _, t in files if any(fnmatch.fnmatchcase(t, g) for g in dev_globs)})
        if devices:
            users[pid] = tuple(devices)
    return users, unreadable


def _proc_locks(proc_locks: str, st: os.stat_result, lockfile: str,
                proc_root: str) -> Optional[List[int]]:
    """Pids that hold a lock on the lock file according to ``/proc/locks``; None if unreadable.

    A line reads ``1: POSIX  ADVISORY  WRITE 1234 fe:00:2146325 0 EOF`` (``->`` marks a
    waiter). The device is the filesystem the inode lives on, which on an overlay (a
    container's /tmp) is not the one ``stat`` reports: a line with the right inode on
    another device counts when that pid has the lock file open.
    """
    raw = _read(proc_locks)
    if raw is None:
        return None
    pids = []
    for line in raw.decode(errors="replace").splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            if int(inode) != st.st_ino:
                continue
            same_device = ((int(major, 16), int(minor, 16))
                           == (os.major(st.st_dev), os.minor(st.st_dev)))
        except ValueError:
            continue
        if same_device or any(t == lockfile for _, t in open_files(pid, proc_root) or ()):
            pids.append(max(pid, 0))
    return pids


def _probe(lockfile: str, own_fd: Optional[int]) -> Optional[int]:
    """The pid ``F_GETLK`` names as holding a lock on the file (0: unknown), None if
    unlocked, -1 if it cannot be probed. Takes no lock, creates nothing."""
    fd = own_fd
    if fd is None:
        try:
            fd = os.open(lockfile, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            return -1
    try:
        request = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        kind, _, _, _, pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, request))
        return None if kind == fcntl.F_UNLCK else max(pid, 0)
    except OSError:
        return -1
    finally:
        if own_fd is None:
            os.close(fd)


def scan(proc_root: str = "/proc", dev_globs: Sequence[str] = DEV_GLOBS,
         lockfile: str = LOCKFILE, proc_locks: Optional[str] = None,
         own_pid: Optional[int] = None) -> Scan:
    """Who holds the TPU now: device users, the lock file's holder, its state."""
    own_pid = os.getpid() if own_pid is None else own_pid
    lockfile = os.path.realpath(lockfile)  # as /proc/<pid>/fd links name it
    users, unreadable = device_users(proc_root, dev_globs)
    lockers: List[int] = []
    owner, openable = None, True
    try:
        st = os.stat(lockfile)
    except OSError:
        state = "absent"
    else:
        owner = _user(st.st_uid)
        openable = os.access(lockfile, os.R_OK | os.W_OK)
        found = _proc_locks(proc_locks or f"{proc_root}/locks", st, lockfile, proc_root)
        if found is None:  # no /proc/locks (a sandbox): ask the kernel about the file itself
            own_fd = next((fd for fd, t in open_files(own_pid, proc_root) or ()
                           if t == lockfile), None)
            pid = _probe(lockfile, own_fd)
            if pid is None and own_fd is not None:
                pid = own_pid  # our own lock does not conflict with us; libtpu keeps its fd open
            found = [] if pid is None else None if pid == -1 else [pid]
        state = "unknown" if found is None else "held" if found else "stale"
        lockers = sorted(set(found or ()))
    holders = []
    for pid in sorted(set(users) | set(lockers)):
        cmdline, user = describe(pid, proc_root) if pid else ("?", "?")
        holders.append(Holder(pid, cmdline, user, users.get(pid, ()), pid in lockers,
                              own=pid == own_pid))
    return Scan(tuple(holders), unreadable, lockfile, state, owner, openable)


def fact(found: Scan) -> str:
    """One line for ``%xla_doctor``: ``nobody``, or each holder."""
    parts = [f"{'this notebook' if h.own else f'pid {h.pid}' if h.pid else 'an unseen process'} "
             f"({h.holds()})" for h in found.holders]
    if found.lockfile_state == "stale":
        parts.append(f"nobody, but {found.lockfile} is left over")
    text = "; ".join(parts) or "nobody"
    if found.unreadable:
        text += (f" ({found.unreadable} process{'es' if found.unreadable != 1 else ''} of "
                 "other users could not be checked)")
    return text


def _own_modules(modules: Mapping) -> str:
    names = [m for m in TPU_USERS if modules.get(m) is not None]
    return ", ".join(names) if names else "neither"


def _whose(holder: Holder) -> str:
    """Whose fix a line gives: this notebook's, a pid's, or the unseen holder's."""
    return ("this notebook" if holder.own else f"pid {holder.pid}" if holder.pid
            else "the unseen process")


def _who(holder: Holder, leftover_pids: Collection[int], modules: Mapping) -> str:
    if holder.own:
        return (f"this notebook's own process (pid {holder.pid}; JAX/TensorFlow imported: "
                f"{_own_modules(modules)})")
    if not holder.pid:
        return "a process this notebook cannot see (another container or pid namespace)"
    left = ", a process left by an earlier colab_xla run" if holder.pid in leftover_pids else ""
    return f"pid {holder.pid} (`{holder.cmdline[:120]}`, user {holder.user}{left})"


def _fix(holder: Holder, leftover_pids: Collection[int], lockfile: str) -> str:
    if holder.own:
        return ("restart the runtime (Runtime > Restart session, or Kernel > Restart): a library "
                "keeps the TPU until its process ends. Then keep JAX/TensorFlow off the TPU in "
                "this notebook (run no JAX code before %%xla_spawn, or set "
                "os.environ['JAX_PLATFORMS'] = 'cpu' before importing jax).")
    if not holder.pid:
        return (f"find it on the host with `sudo lsof -w {lockfile} /dev/accel0 /dev/vfio/0` and "
                "stop it, or restart the runtime.")
    if holder.pid in leftover_pids:
        return (f"run %xla_doctor --kill-leftovers (it kills pid {holder.pid} and the other "
                "leftovers).")
    sudo = "" if holder.user in (_user(os.getuid()), "?") or os.getuid() == 0 else "sudo "
    return (f"stop it where it runs, or `!{sudo}kill {holder.pid}` (`!{sudo}kill -9 "
            f"{holder.pid}` if it does not end); or restart the runtime.")


def problems(found: Scan, leftover_pids: Collection[int] = (),
             modules: Optional[Mapping] = None, refuse: bool = True) -> List[Problem]:
    """The TPU held by someone else (fatal), and a lock file left over (fatal if libtpu here
    cannot open it, else a note). ``leftover_pids``: colab_xla's own leftovers. With
    ``refuse=False`` (``COLAB_XLA_TPU_HOLDERS=warn``) every problem is a note."""
    modules = sys.modules if modules is None else modules
    if not refuse:
        return [dataclasses.replace(p, fatal=False)
                for p in problems(found, leftover_pids, modules)]
    result = []
    if found.holders:
        who = "; ".join(f"{_who(h, leftover_pids, modules)} {h.holds()}" for h in found.holders)
        fixes = " ".join(f"For {_whose(h)}: "
                         f"{_fix(h, leftover_pids, found.lockfile)}" for h in found.holders)
        result.append(Problem(
            "tpu-held", f"The TPU is in use, so every replica would fail (\"The TPU is "
                        "already in use by process with pid ...\", or \"open(/dev/vfio/0): "
                        f"Device or resource busy\"): {who}.", fixes))
    if found.lockfile_state == "stale" or (found.lockfile_state == "unknown"
                                           and not found.lockfile_openable):
        if found.lockfile_openable:
            result.append(Problem(
                "tpu-stale-lock", f"{found.lockfile} is left over from a process that ended "
                                  "without removing it (killed, or it crashed); nobody locks it. "
                                  "A libtpu that locks it (as openxla's tpu_initialize_util "
                                  "does) takes it over; older ones refused to start while it "
                                  "existed (jax#10192).",
                f"if replicas fail with \"TPU in use\", remove it: !rm {found.lockfile}",
                fatal=False))
        else:
            sudo = "" if os.getuid() == 0 else "sudo "
            result.append(Problem(
                "tpu-stale-lock", f"{found.lockfile} belongs to user {found.lockfile_owner} and "
                                  "this user cannot open it, so libtpu refuses to start in every "
                                  "replica (\"The TPU is already in use by another process "
                                  "probably owned by another user\")"
                                  + ("; nobody locks it." if found.lockfile_state == "stale"
                                     else "."),
                f"remove it: !{sudo}rm {found.lockfile}"
                + (f" (if a process of {found.lockfile_owner} still uses the TPU, stop it first)"
                   if found.lockfile_state != "stale" else "")))
    return result
