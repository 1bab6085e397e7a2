"""This process's random token, for names that must differ from every other process's.

A warm session cell needs two new names (its module's and its run's). Rather than a random
token (a ``getrandom(2)``) for each, each is a count of its own and this token, drawn once
per process, and again in a process forked from it (whose names must differ from its
parent's).
"""

from __future__ import annotations

import os
import secrets

_token = secrets.token_hex(4)


def token() -> str:
    """8 hex digits, this process's own."""
    return _token


def _forked() -> None:
    global _token
    _token = secrets.token_hex(4)


os.register_at_fork(after_in_child=_forked)
