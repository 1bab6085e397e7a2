"""``%xla_doctor``: where this notebook runs and what would stop ``%%xla_spawn``, each problem
with its fix. Reads the environment, package metadata, the PCI bus and colab_xla's own
records; never initializes the XLA runtime (nor imports torch_xla if it is not imported).

Example::

    >>> report = diagnose(environ={"PJRT_DEVICE": "CPU", "XLA_USE_SPMD": "1"}, history=[])
    >>> [p.code for p in report.problems]
    ['spmd']
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence, Tuple

from . import cluster, hardware, launch, preflight, processes, targets, tpu_holders
from .. import runtimes
from .defaults import Defaults
from ..errors import Problem
from ..runtimes import torch_xla as torch_xla_runtime
from ..runtimes.plan import ReplicaCountError


@dataclass
class Report:
    facts: List[Tuple[str, str]] = field(default_factory=list)
    problems: List[Problem] = field(default_factory=list)

    def render(self) -> str:
        width = max(len(k) for k, _ in self.facts) if self.facts else 0
        lines = ["colab_xla doctor"] + [f"  {k:<{width}}  {v}" for k, v in self.facts]
        if not self.problems:
            lines.append("No problems found: %%xla_spawn should run here.")
        for i, problem in enumerate(self.problems, 1):
            lines += ["", f"{i}. {problem.message}", f"   Fix: {problem.fix}"]
        return "\n".join(lines)


def where(environ: Mapping[str, str]) -> str:
    if "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in environ:
        return "Google Colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in environ or "KAGGLE_URL_BASE" in environ:
        return "Kaggle"
    if "TPU_ACCELERATOR_TYPE" in environ or hardware.device_files("TPU"):
        return "a TPU VM"
    return f"a local machine ({platform.system()} {platform.machine()}, {os.cpu_count()} CPUs)"


def installed_version(package: str) -> Optional[str]:
    """The installed version of ``package`` (a distribution's name), or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _session_fact(session) -> str:
    """This notebook process's ``%xla_session``: its replicas' pids, or why it ended."""
    if session is None:
        return "none"
    if not session.up:
        return f"ended ({session.ended})"
    pids = ", ".join(str(rep.pid) for _, rep in sorted(session.replicas.items()))
    return f"up, {len(session.replicas)} replicas (pids {pids}), {session.cells_run} cells run"


def _cluster_fact(connected, ray_version: Optional[str]) -> str:
    """This notebook's ``%xla_cluster`` connection (``connected``, or None), and whether
    Ray, which it needs, is installed."""
    if connected is None:
        if ray_version is None:
            return "not connected (Ray not installed: pip install 'colab_xla[ray]')"
        return f"not connected (Ray {ray_version}: %xla_cluster connect, or local)"
    warm = connected.session is not None and connected.session.up
    return (f"connected to {connected.address}: {len(connected.hosts)} hosts, "
            f"{connected.replicas} replicas, {connected.slice_name or 'CPU hosts'}"
            + ("; a session is up on every host" if warm else ""))


def likely_cause(history: Sequence[str],
                 runtime: Optional[runtimes.Runtime] = None) -> Optional[str]:
    """The latest notebook cell that makes a call outside %%xla_spawn that starts
    ``runtime`` (a :class:`colab_xla.runtimes.Runtime`; None: torch_xla's, a call that
    initializes the XLA runtime)."""
    pattern = (runtime or torch_xla_runtime.RUNTIME).starting_calls
    for number in range(len(history) - 1, 0, -1):
        cell = history[number] or ""
        if cell.lstrip().startswith(("%%xla_spawn", "get_ipython().run_cell_magic('xla_spawn'")):
            continue
        match = pattern.search(cell)
        if match:
            return f"In[{number}] calls `{match.group(0)}`"
    return None


def diagnose(environ: Mapping[str, str] = os.environ, history: Sequence[str] = ()) -> Report:
    report = Report()
    report.facts.append(("running on", where(environ)))
    versions = {p: installed_version(p) for p in ("torch", "torch_xla", "ipykernel", "ipywidgets")}
    report.facts.append(("python", platform.python_version()))
    report.facts.append(("packages", ", ".join(f"{p} {v or 'not installed'}"
                                               for p, v in versions.items())))

    if versions["torch_xla"] is None:
        report.problems.append(Problem("torch-xla-missing", "torch_xla is not installed.",
                                       torch_xla_runtime.TORCH_XLA_INSTALL_HINT))
    elif versions["torch"] and versions["torch"].split("+")[0].rsplit(".", 1)[0] != \
            versions["torch_xla"].split("+")[0].rsplit(".", 1)[0]:
        report.problems.append(Problem(
            "versions", f"torch {versions['torch']} and torch_xla {versions['torch_xla']} are "
                        "not the same release; torch_xla's native code is built for one torch.",
            f"pip install torch=={versions['torch_xla'].split('+')[0]} (or the torch_xla that "
            "matches your torch), then restart the runtime."))

    hw = hardware.Hardware(pjrt_device=environ.get("PJRT_DEVICE") or None)
    if versions["torch_xla"] is not None:
        hw = hardware.detect(environ)
    try:
        plan = torch_xla_runtime.RUNTIME.plan(None, hw)
        replicas = plan.replicas if plan.replicas is not None else "all local devices"
        chips = f", {hw.tpu_chips} TPU chips on the PCI bus" if hw.tpu_chips else ""
        report.facts.append(("device",
                             f"{plan.device_type}: {replicas} replicas by default{chips}"))
    except ReplicaCountError as exc:
        report.facts.append(("device", str(exc)))
    if hw.tpu_chips and (hw.pjrt_device or "").upper() == "CPU":
        report.problems.append(Problem(
            "cpu-on-tpu", f"PJRT_DEVICE=CPU although {hw.tpu_chips} TPU chips are here: "
                          "replicas are simulated on CPU.",
            "del os.environ['PJRT_DEVICE'] to use the TPU.", fatal=False))

    initialized = torch_xla_runtime.runtime_initialized()
    report.facts.append(("XLA runtime in this process", "initialized" if initialized else
                         "not initialized (good)"))
    if initialized:
        cause = likely_cause(history)
        message = torch_xla_runtime.RUNTIME_INITIALIZED + (f" Likely: {cause}." if cause else "")
        report.problems.append(Problem(torch_xla_runtime.INITIALIZED, message,
                                       torch_xla_runtime.RUNTIME_INITIALIZED_FIX))

    report.problems += preflight.environment_problems(environ)

    method = Defaults.read(environ).start_method
    server = launch.forkserver_pid()
    report.facts.append(("start method", f"{method} by default" + (
        f"; forkserver running (pid {server})" if server else "")))
    try:
        report.problems += preflight.launch_problems(launch.Launch(method), environ)
    except ValueError as exc:
        report.problems.append(Problem("start-method", f"COLAB_XLA_START_METHOD: {exc}",
                                       "Set it to fork, spawn or forkserver.", fatal=False))

    report.facts.append(("session", _session_fact(targets.local_session())))
    report.facts.append(("cluster", _cluster_fact(cluster.current(), installed_version("ray"))))
    found = processes.leftovers()
    report.facts.append(("leftover processes", str(len(found))))
    if found:
        report.problems.append(preflight.leftovers_problem(found))

    for runtime in runtimes.registered():
        report.facts += runtime.doctor_facts(hw, environ, installed_version)

    holders = tpu_holders.scan()
    report.facts.append(("TPU held by", tpu_holders.fact(holders)))
    if hw.device == "TPU":
        report.problems += tpu_holders.problems(holders, {left.pid for left in found})
    return report
