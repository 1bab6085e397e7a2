"""Multislice's "discovery once" inside a replica process
(:mod:`colab_xla.runtimes.runtime_clients`): each runtime client recorded with its call,
``SKIP_MEGASCALE_PJRT_CLIENT`` set from the first one on, and a client that would run
MegaScale discovery a second time refused, named.

Units on a stand-in for JAX's ``xla_bridge``; then real processes: jax's own import
watched, and torch_xla replicas (both CPU simulations) after their first ``device``.
No TPU here: the refusal is shown in a real replica by counting CPU as a discovering
platform (what only a multislice pod can confirm is said in the module's docstring's
terms: that libtpu then skips discovery).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest

from colab_xla.runtimes import runtime_clients as rc
from test_jax_runtime import needs_jax  # tests/ is on sys.path


pytestmark = [pytest.mark.stacks("colab", "kaggle")]


@pytest.fixture
def fresh(monkeypatch):
    """A process with no runtime client yet (the module's record and the variable)."""
    monkeypatch.setattr(rc, "_clients", [])
    monkeypatch.setenv(rc.SKIP, "")  # (so that the test's end restores it as it was)
    monkeypatch.delenv(rc.SKIP)
    monkeypatch.setattr(rc, "_where", lambda: "In[3], line 2: jnp.ones(3)")
    return rc


def fake_bridge(started: list, fail: bool = False):
    bridge = types.ModuleType("fake_xla_bridge")

    def _init_backend(platform):
        if fail:
            raise RuntimeError(f"Backend '{platform}' failed to initialize")
        started.append((platform, os.environ.get(rc.SKIP)))
        return f"client-{platform}"

    bridge._init_backend = _init_backend
    return bridge


def test_the_first_client_is_recorded_with_its_call_and_later_ones_skip_discovery(fresh):
    started = []
    bridge = fake_bridge(started)
    rc._watch_jax(bridge)
    rc._watch_jax(bridge)  # once only
    assert bridge._init_backend("tpu") == "client-tpu"
    assert started == [("tpu", None)]  # the first one discovers
    assert os.environ[rc.SKIP] == "true"
    assert bridge._init_backend("cpu") == "client-cpu"
    assert started[-1] == ("cpu", "true")
    assert rc.clients() == [rc.Client("jax", "tpu", "In[3], line 2: jnp.ones(3)"),
                            rc.Client("jax", "cpu", "In[3], line 2: jnp.ones(3)")]
    assert rc.describe() == ("2 runtime clients: jax's (TPU) by In[3], line 2: jnp.ones(3); "
                             "jax's (CPU) by In[3], line 2: jnp.ones(3)")


def test_a_second_discovering_client_is_refused_before_it_starts_naming_both_calls(fresh):
    started = []
    bridge = fake_bridge(started)
    rc._watch_jax(bridge)
    rc.created("torch_xla", "TPU", "In[2], line 1: device")
    del os.environ[rc.SKIP]  # taken away (as torch_xla's nested contexts once did)
    with pytest.raises(rc.SecondDiscovery, match=(
            r"jax is starting a second TPU runtime client in this process \(In\[3\], line 2: "
            r"jnp.ones\(3\)\) with SKIP_MEGASCALE_PJRT_CLIENT unset, so it would run MegaScale "
            r"discovery again.*This process has 1 runtime client: torch_xla's \(TPU\) by "
            r"In\[2\], line 1: device\.")):
        bridge._init_backend("tpu")
    assert started == [] and len(rc.clients()) == 1  # never started, not recorded
    bridge._init_backend("cpu")  # a CPU client never discovers
    assert started == [("cpu", None)] and os.environ[rc.SKIP] == "true"
    bridge._init_backend("tpu")  # with the variable back, a second TPU client may start
    assert started[-1] == ("tpu", "true")


def test_a_backend_that_fails_to_start_is_not_counted(fresh):
    bridge = fake_bridge([], fail=True)
    rc._watch_jax(bridge)
    with pytest.raises(RuntimeError, match="failed to initialize"):
        bridge._init_backend("tpu")
    assert rc.clients() == [] and rc.SKIP not in os.environ


def test_the_call_is_the_cells_line_on_this_threads_stack(tmp_path):
    path = tmp_path / "cell.py"
    path.write_text("x = 1\nsite = call_site(PATH, 'In[7]')\n")
    ns = {"call_site": rc.call_site, "PATH": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    assert ns["site"] == "In[7], line 2: site = call_site(PATH, 'In[7]')"
    assert rc.call_site(None, "In[7]").startswith(__file__)  # no cell: the caller's file


@needs_jax
@pytest.mark.jax
@pytest.mark.timeout(120)
def test_jax_is_watched_from_its_import_on_without_importing_it_early():
    code = textwrap.dedent("""
        import os, sys
        os.environ["JAX_PLATFORMS"] = "cpu"
        from colab_xla.runtimes import runtime_clients as rc
        rc.install(lambda: "the test's call")
        assert "jax" not in sys.modules  # watching costs no import
        import jax.numpy as jnp
        assert os.environ.get(rc.SKIP) is None  # imported, no backend yet
        jnp.ones(3).block_until_ready()
        print(rc.describe(), os.environ[rc.SKIP])
        """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, env={k: v for k, v in os.environ.items()
                                            if k != rc.SKIP})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1 runtime client: jax's (CPU) by the test's call true"


# -- real replicas ----------------------------------------------------------------------------

CLIENTS_CELL = """
import os
from colab_xla.runtimes import runtime_clients as rc
before = os.environ.get(rc.SKIP)
device
(before, os.environ.get(rc.SKIP), [(c.library, c.platform, c.call) for c in rc.clients()])
"""


@pytest.mark.xla
@pytest.mark.timeout(300)
@pytest.mark.parametrize("simulate", ["processes", "threads"])
def test_every_replica_process_records_torch_xlas_client_and_sets_the_guard(simulate):
    from colab_xla.notebook.targets import run_cell

    outcome = run_cell(CLIENTS_CELL.lstrip("\n"), replicas=2, announce=None,
                       label="In[5]", simulate=simulate, timeout=240)
    assert outcome.ok, {i: r.error for i, r in outcome.replicas.items()}
    values = outcome.results()
    first_use = ("torch_xla", "cpu", "In[5], line 5: device")  # (line 1: %%xla_spawn)
    if simulate == "processes":  # a process each: each one's first client is its own
        assert values == {i: (None, "true", [first_use]) for i in range(2)}
    else:  # threads of one process: one client, the variable process-wide
        assert [v[1:] for v in values.values()] == [("true", [first_use])] * 2
        assert sorted(str(v[0]) for v in values.values()) in (["None", "None"],
                                                               ["None", "true"])


@needs_jax
@pytest.mark.xla
@pytest.mark.jax
@pytest.mark.timeout(300)
def test_a_jax_backend_that_would_discover_again_in_a_replica_is_refused_naming_its_line():
    from colab_xla.notebook.targets import run_cell

    # CPU counted as a discovering platform (on a TPU it is TPU): torch_xla's client
    # first, the guard taken away, then a real JAX backend starting.
    cell = textwrap.dedent("""
        import os
        os.environ["JAX_PLATFORMS"] = "cpu"
        from colab_xla.runtimes import runtime_clients as rc
        rc.DISCOVERING_PLATFORMS = ("tpu", "cpu")
        device
        del os.environ[rc.SKIP]
        import jax.numpy as jnp
        x = jnp.ones(3)
        """).lstrip("\n")
    outcome = run_cell(cell, replicas=1, announce=None, label="In[6]", timeout=240)
    error = outcome.replicas[0].error
    # (JAX re-raises what stopped a backend it was told to start as "Unable to
    # initialize backend 'cpu': ...", a RuntimeError with the message kept.)
    assert error is not None and error.ename == "RuntimeError", error
    assert ("jax is starting a second CPU runtime client in this process (In[6], line 9: "
            "x = jnp.ones(3)) with SKIP_MEGASCALE_PJRT_CLIENT unset") in error.evalue
    assert "1 runtime client: torch_xla's (CPU) by In[6], line 6: device" in error.evalue
    assert "In[6], line 9" in error.traceback
