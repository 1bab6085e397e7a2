"""The IPython shell the tests drive the magics through, and the ``ip`` fixture.

``get_ipython()`` is IPython's test-friendly TerminalInteractiveShell (a singleton, started
once); ``ip = ip_fixture(...)`` in a test module is the fixture that hands it out with
colab_xla loaded.
"""

from typing import Callable, Optional

import pytest
from IPython.testing import globalipapp


def get_ipython():
    """The test-friendly TerminalInteractiveShell (a singleton, started once)."""
    globalipapp.start_ipython()
    return globalipapp.get_ipython()


def ip_fixture(*, scope: str = "function", after: Optional[Callable] = None):
    """The ``ip`` fixture of a test module: :func:`get_ipython` with ``%load_ext colab_xla``
    run, of ``scope``; ``after(shell)`` is called once its tests are done with it (a module
    stops there what its tests may leave running: a session, a cluster)."""

    @pytest.fixture(scope=scope, name="ip")
    def ip():
        shell = get_ipython()
        shell.run_line_magic("load_ext", "colab_xla")
        yield shell
        if after is not None:
            after(shell)

    return ip

