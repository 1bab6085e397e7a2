"""Tutorial 07 (a TPU pod slice from a notebook, ``%xla_cluster``) in a real kernel.

The notebook runs once (module fixture) through ``run_notebooks.execute_notebook``; it starts
a local Ray cluster of 2 CPU hosts of 2 replicas each. The tests read its executed copy: every
replica of every host ran each cell under its ``host h · replica i`` heading, with ``index`` the
global ordinal (``host * 2 + local_index``); a class defined in the notebook came back with
``-o`` as the notebook's class; the data-parallel training across the hosts left the same
weights on all 4 replicas (gradients all-reduced through gloo across the hosts), different from
the initial ones; ``%xla_cluster`` shows the cluster and ``%xla_cluster stop`` ends it.
"""

from __future__ import annotations

import ast
import re

import nbformat
import pytest

import run_notebooks  # tools/ is on sys.path (conftest.py)
from test_notebooks import assert_every_cell_ran, cell, text_of  # noqa: E402

# Ray is the optional extra colab_xla[ray]: the dev stack has it, the users' stacks do not.
pytest.importorskip("ray", reason="Ray (colab_xla[ray]) is not installed in this stack")
pytestmark = [pytest.mark.notebook, pytest.mark.cluster, pytest.mark.timeout(600)]

CLUSTER = run_notebooks.NOTEBOOKS_DIR / "07-pod-slice.ipynb"
HOSTS, PER_HOST = 2, 2
REPLICAS = HOSTS * PER_HOST
TIMEOUT = 240  # per cell
CLUSTER_CELLS = ("where", "shards", "train")  # the %%xla_spawn cells, all on the cluster


@pytest.fixture(scope="module")
def cluster_nb(tmp_path_factory):
    return run_notebooks.execute_notebook(CLUSTER, tmp_path_factory.mktemp("cluster"), TIMEOUT)[0]


def host_blocks(text: str):
    """``{global ordinal: (host, lines)}`` of a %%xla_spawn run on the cluster, after checking
    that all REPLICAS finished, each under its ``── host h · replica i · done`` heading."""
    assert re.search(rf"^{REPLICAS} replicas on CPU: {REPLICAS} done in \d+\.\d\d s"
                     r"( · results in `\w+`)?$",
                     text, re.M), text
    blocks, current = {}, None
    for line in text.splitlines():
        m = re.match(r"── host (\d+) · replica (\d+) · (\w+) · \d+\.\d\d s$", line)
        if m:
            assert m[3] == "done", line
            current = int(m[2])
            assert current not in blocks, text
            blocks[current] = (int(m[1]), [])
        elif line.startswith("── "):
            current = None
        elif current is not None:
            blocks[current][1].append(line)
    assert sorted(blocks) == list(range(REPLICAS)), text
    return blocks


def test_sizes_are_parameters():  # (saved clean, with stable ids: see test_tutorials)
    nb = nbformat.read(CLUSTER, as_version=4)
    setup = cell(nb, "setup").source
    assert f"HOSTS = {HOSTS}" in setup and f"PER_HOST = {PER_HOST}" in setup, setup
    assert cell(nb, "start").source.strip() == "%xla_cluster local --hosts {HOSTS} -n {PER_HOST}"
    for cell_id in CLUSTER_CELLS:  # they run on the cluster: no option of their own for that
        first = cell(nb, cell_id).source.splitlines()[0]
        assert first.startswith("%%xla_spawn") and "--fresh" not in first and " -n " not in first
    # the pod's way is told, with the address it uses
    assert "%xla_cluster connect" in cell(nb, "setup-md").source
    assert "auto" in cell(nb, "setup-md").source


def test_runs_without_errors(cluster_nb):
    assert_every_cell_ran(cluster_nb)


def test_the_cluster_starts_with_its_hosts(cluster_nb):
    started = text_of(cell(cluster_nb, "start"))
    assert re.search(rf"^colab_xla cluster: {HOSTS} hosts ready in [\d.]+ s\.$", started,
                     re.M), started
    assert re.search(rf"^colab_xla cluster: up · {HOSTS} hosts · {REPLICAS} replicas · CPU hosts"
                     r" · \S+ \(local, started by this notebook\) · cells run: 0$",
                     started, re.M), started
    agents = re.findall(rf"^  host (\d+): .* · {PER_HOST} CPU replicas · agent pid (\d+) · ",
                        started, re.M)
    assert [int(h) for h, _ in agents] == list(range(HOSTS)), started
    assert len({pid for _, pid in agents}) == HOSTS, started  # an agent per host


def test_every_replica_of_every_host_knows_its_place(cluster_nb):
    blocks = host_blocks(text_of(cell(cluster_nb, "where")))
    pids = {}
    for i, (h, lines) in blocks.items():
        assert len(lines) == 1, (i, lines)
        m = re.fullmatch(r"replica (\d+): host (\d+), local_index (\d+), pid (\d+), "
                         r"world size (\d+)", lines[0])
        assert m, (i, lines)
        index, host, local_index, pid, world = (int(v) for v in m.groups())
        assert index == i and host == h, (i, h, lines)  # printed where the heading says
        assert 0 <= local_index < PER_HOST and index == host * PER_HOST + local_index, lines
        assert world == REPLICAS, lines  # the world is every replica of every host
        pids[i] = pid
    assert sorted(h for h, _ in blocks.values()) == [h for h in range(HOSTS)
                                                     for _ in range(PER_HOST)]
    assert len(set(pids.values())) == REPLICAS, pids  # a process per replica


def test_the_notebooks_class_travels_and_comes_back(cluster_nb):
    blocks = host_blocks(text_of(cell(cluster_nb, "shards")))
    for i, (h, lines) in blocks.items():
        shard = f"Shard({i} of {REPLICAS}, host {h})"
        assert len(lines) == 2 and re.fullmatch(rf"{re.escape(shard)} on pid \d+", lines[0]), \
            (i, lines)  # describe(), the notebook's function, ran on the replica
        assert lines[1] == f"Out: {shard}", (i, lines)
    shown = text_of(cell(cluster_nb, "shards-nb")).splitlines()
    assert shown[0] == "{" + ", ".join(
        f"{i}: Shard({i} of {REPLICAS}, host {blocks[i][0]})" for i in range(REPLICAS)) + "}", shown
    assert shown[1] == "every value is the notebook's Shard: True", shown


def weights_of(line: str):
    """``(weight values, bias values)`` of an ``Out: {'weight': tensor(...), 'bias': ...}``."""
    m = re.fullmatch(r"Out: \{'weight': tensor\((\[\[.*\]\])\), 'bias': tensor\((\[.*\])\)\}",
                     line)
    assert m, line
    return tuple(ast.literal_eval(re.sub(r"\s+", "", m[1]))[0]), \
        tuple(ast.literal_eval(m[2]))


def test_training_across_hosts_leaves_identical_weights(cluster_nb):
    blocks = host_blocks(text_of(cell(cluster_nb, "train")))
    final, first_losses = {}, set()
    for i, (h, lines) in blocks.items():
        assert len(lines) == 2, (i, lines)
        m = re.fullmatch(rf"replica {i} \(host {h}\): loss ([\d.]+) -> ([\d.]+)", lines[0])
        assert m, (i, lines)
        assert float(m[2]) < float(m[1]) / 5, (i, lines)  # it learned
        first_losses.add(m[1])
        final[i] = weights_of(lines[1])
    assert len(first_losses) == REPLICAS, first_losses  # each replica its own shard of the data
    # the point: the gradients were all-reduced over both hosts, so every replica, whatever
    # its data, took the same steps
    assert len(set(final.values())) == 1, final
    shown = text_of(cell(cluster_nb, "check")).splitlines()
    assert shown[0] == f"replicas: {list(range(REPLICAS))}", shown
    initial = re.fullmatch(r"initial weight: +(\[.*\])", shown[1])
    trained = re.fullmatch(r"weight of replica 0: +(\[.*\])", shown[2])
    assert initial and trained, shown
    initial, trained = ast.literal_eval(initial[1]), ast.literal_eval(trained[1])
    assert trained == pytest.approx(list(final[0][0]), abs=1e-3), (trained, final[0])
    assert max(abs(a - b) for a, b in zip(initial, trained)) > 0.1, (initial, trained)
    assert shown[3:] == ["identical on every replica: True", "changed by training: True"], shown


def test_status_and_stop(cluster_nb):
    status = text_of(cell(cluster_nb, "status"))
    started = text_of(cell(cluster_nb, "start"))
    assert re.match(rf"colab_xla cluster: up · {HOSTS} hosts · {REPLICAS} replicas · CPU hosts · "
                    rf"\S+ \(local, started by this notebook\) · cells run: "
                    rf"{len(CLUSTER_CELLS)}$", status.splitlines()[0]), status
    # the same agents as when it started
    assert re.findall(r"agent pid (\d+)", status) == re.findall(r"agent pid (\d+)", started)
    assert text_of(cell(cluster_nb, "stop")).splitlines() == [
        "colab_xla cluster: stopped.",
        "colab_xla cluster: not connected (%xla_cluster connect, or local)."]
