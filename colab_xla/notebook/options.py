"""The options of a run, checked before anything starts: the ``%%xla_spawn`` line split as a
shell would, names, ``--env``, ``--pull``, ``--timeout``, ``--cache``; and which options each
action of ``%xla_session`` and ``%xla_cluster`` takes (:func:`check_session_line`,
:func:`check_cluster_line`). IPython-free; every refusal is an
:class:`~colab_xla.errors.OptionError` whose message says what to give instead.

IPython's ``parse_argstring`` splits with ``shlex`` in non-POSIX mode (IPython 7.34 and
later alike): quotes stay inside the values (``--env XLA_FLAGS="--a --b"`` gave
``XLA_FLAGS="--a`` and ``--b"``), and an unclosed quote raised a bare ValueError. Here
quotes group and are removed, a backslash escapes the next character, ``#`` is text::

    >>> split_line('-n 4 --env XLA_FLAGS="--xla_a --xla_b=1" -o out')
    ['-n', '4', '--env', 'XLA_FLAGS=--xla_a --xla_b=1', '-o', 'out']

IPython substitutes ``$name`` and ``{expr}`` of the notebook in a magic's line before the
magic sees it, so a value taken from a notebook variable keeps its spaces only in quotes:
``--env XLA_FLAGS="$flags"``.
"""

from __future__ import annotations

import keyword
import math
import os
import re
import shlex
from typing import Dict, List, Mapping, Optional, Sequence

from ..errors import OptionError
from ..runtimes.simulation import SIMULATIONS



class LineError(OptionError):
    """The line cannot be split into arguments (the message says where and what to do)."""


def split_line(line: str, magic: str = "%%xla_spawn") -> List[str]:
    """``line`` as a shell would split it, or :class:`LineError` for an unclosed quote or a
    backslash at the end."""
    lex = shlex.shlex(line, posix=True)
    lex.whitespace_split = True
    lex.commenters = ""  # "#" is text in a value (XLA_FLAGS, a path)
    args: List[str] = []
    while True:
        try:
            token = lex.get_token()
        except ValueError:
            raise LineError(_unsplittable(line, lex, magic)) from None
        if token is None:  # posix mode: None at the end (an empty token is "")
            return args
        args.append(token)


def pull_names(items: Sequence[str]) -> List[str]:
    """The names of every ``--pull``, in order, each once::

        >>> pull_names(["model,losses", " model "])
        ['model', 'losses']
    """
    names: List[str] = []
    for item in items:
        parts = [name.strip() for name in item.split(",") if name.strip()]
        if not parts:
            raise OptionError(f"--pull {shlex.quote(item)}: give one NAME or more "
                             "(--pull model,losses).")
        names += parts
    return list(dict.fromkeys(names))


def check_output(name: Optional[str], pull: Sequence[str]) -> None:
    """``-o NAME``: a variable the notebook can use, and not one --pull stores into too."""
    if name is None:
        return
    if not is_name(name):
        raise OptionError(f"-o {shlex.quote(name)}: NAME must be a Python identifier (not a "
                         "keyword), the notebook variable that gets the values.")
    if name in pull:
        raise OptionError(f"-o {name} and --pull {name} would both store into the notebook's "
                         f"{name}: give -o another NAME.")


def is_name(name: str) -> bool:
    """A name a notebook variable can have: ``losses``, not ``2fast`` or ``class``."""
    return name.isidentifier() and not keyword.iskeyword(name)


def _unsplittable(line: str, lex: shlex.shlex, magic: str) -> str:
    shown = f"{magic} {line.strip()}"
    if lex.state in lex.quotes:  # the line ended inside a quote
        quote, column = lex.state, _open_quote(line) + 1
        return (f"{shown}: the {quote} at column {column} opens a quoted value that is never "
                f"closed. Close it (--env XLA_FLAGS={quote}--a --b{quote}), or write a {quote} "
                f"that is part of a value as \\{quote}.")
    return (f"{shown}: the line ends with a backslash, which escapes nothing. Remove it, or "
            "write \\\\ for a backslash that is part of a value.")


def _open_quote(line: str) -> int:
    """Where the quote that is never closed starts (the rules of POSIX shlex)."""
    quote, start, i = None, -1, 0
    while i < len(line):
        c = line[i]
        if c == "\\" and quote != "'":
            i += 1  # escapes the next character (not inside '...')
        elif quote is None and c in "'\"":
            quote, start = c, i
        elif c == quote:
            quote = None
        i += 1
    return start


def parse_env(assignments) -> Dict[str, str]:
    """``["XLA_IR_DEBUG=1", "A=b=c"]`` -> ``{"XLA_IR_DEBUG": "1", "A": "b=c"}``; a KEY
    given twice with two values is refused (which one was meant cannot be told)."""
    env: Dict[str, str] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OptionError(f"--env {item}: write KEY=VALUE, e.g. --env XLA_IR_DEBUG=1.")
        if env.get(key, value) != value:
            first, second = (shlex.quote(f"{key}={v}") for v in (env[key], value))
            raise OptionError(f"--env {first} and --env {second} set {key} twice: keep one.")
        env[key] = value
    return env


def check_run(*, replicas: Optional[int], timeout: Optional[float], env: Mapping[str, str],
              pull: Sequence[str], pull_from: Optional[int], cache_dir: Optional[str],
              launch, simulate: str = SIMULATIONS[0]) -> Optional[str]:
    """Refuse bad options of :func:`colab_xla.notebook.targets.run_cell`; return ``cache_dir`` made
    absolute (and created, checked writable), or None."""
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):  # nan > 0 is False
        raise OptionError(f"--timeout {timeout:g}: the timeout must be more than 0 seconds and "
                          "finite; leave -t out to run without one.")
    for key, value in env.items():
        if not _ENV_NAME.fullmatch(key) or not isinstance(value, str):
            raise OptionError(f"--env {key}={value}: KEY must be letters, digits and '_' "
                              "(not starting with a digit), VALUE a string.")
    for name in pull:
        if not is_name(name):
            raise OptionError(f"--pull {name}: each NAME must be a Python identifier (not a "
                              "keyword).")
    if pull_from is not None and (pull_from < 0 or not pull):
        raise OptionError(f"--pull-from {pull_from}: give a replica ordinal (0 or more) "
                          "together with --pull NAME.")
    if simulate not in SIMULATIONS:
        raise OptionError(f"--simulate {simulate}: give processes (one process per replica, "
                          "as on TPU v4 and later; the default) or threads (one process, a "
                          "thread per replica, as on TPU v2/v3), with --simulate or in "
                          "COLAB_XLA_SIMULATE.")
    if launch.debug_single and replicas not in (None, 1):
        raise OptionError(f"-n {replicas} with --debug-single: it runs one replica; leave -n out.")
    return None if cache_dir is None else _cache_dir(cache_dir)


def check_pull_from(pull_from: Optional[int], replicas: Optional[int]) -> None:
    """``--pull-from`` names a replica the run has (once the plan says how many)."""
    if pull_from is not None and replicas is not None and pull_from >= replicas:
        raise OptionError(f"--pull-from {pull_from}: this run has {replicas} "
                          f"replica{'s' if replicas != 1 else ''} (0-{replicas - 1}); "
                          "give one of those ordinals.")


def check_session_line(action: str, given: Sequence[str], switch: Optional[str] = None,
                       auto: bool = False) -> None:
    """``%xla_session ACTION [SWITCH]``: ``given``, the options of
    :meth:`~colab_xla.notebook.request.SessionRequest.given`, are for ``start``; on and off
    (``switch``) for ``auto``; ``--auto`` for ``start`` and ``restart``."""
    if given and action != "start":
        raise OptionError(f"%xla_session {action} takes no {', '.join(given)}: options are "
                          "given to %xla_session start.")
    if switch is not None and action != "auto":
        raise OptionError(f"%xla_session {action} {switch}: on and off are for %xla_session "
                          "auto.")
    if auto and action not in ("start", "restart"):
        raise OptionError(f"%xla_session {action} --auto: --auto is for %xla_session start "
                          "(or restart); %xla_session auto turns it on.")


# The options each action of %xla_cluster takes, but connect (which takes every one).
CLUSTER_ACTION_OPTIONS = {"status": (), "stop": (), "local": ("--hosts", "-n", "--slices")}


def check_cluster_line(action: str, *, address: str = "auto", hosts: Optional[int] = None,
                       replicas: Optional[int] = None, slice_name: Optional[str] = None,
                       slices: Optional[int] = None) -> None:
    """``%xla_cluster ACTION``: the options it takes (:data:`CLUSTER_ACTION_OPTIONS`), and
    counts of 1 or more."""
    given = [flag for flag, value in (("ADDRESS", address != "auto"),
                                      ("--hosts", hosts is not None),
                                      ("-n", replicas is not None), ("--slice", slice_name),
                                      ("--slices", slices is not None)) if value]
    takes = CLUSTER_ACTION_OPTIONS.get(action)
    if takes is not None and set(given) - set(takes):
        raise OptionError(f"%xla_cluster {action} takes no "
                          f"{', '.join(sorted(set(given) - set(takes)))}: those are for "
                          "%xla_cluster connect" + (" (local takes --hosts, -n and --slices)."
                                                    if action == "local" else "."))
    for value, flag in ((hosts, "--hosts"), (replicas, "-n"), (slices, "--slices")):
        if value is not None and value < 1:
            raise OptionError(f"{flag} {value}: give 1 or more.")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _cache_dir(path: str) -> str:
    """``--cache DIR`` made (if new) and checked writable here, before replicas need it."""
    if not path.strip():  # abspath("") would be the notebook's working directory
        raise OptionError("--cache '': give a directory (--cache ~/xla_cache), or leave "
                          "--cache out to compile without the cache.")
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise OptionError(f"--cache {path}: cannot create it ({exc.strerror}); choose "
                          "another DIR.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OptionError(f"--cache {path}: not writable by this user; choose another DIR.")
    return path
