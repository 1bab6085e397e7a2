"""The CPU simulation of a TPU host, as the torch_xla runtime plans it
(:mod:`colab_xla.runtimes.torch_xla`): the two models (:data:`SIMULATIONS`, also the
``--simulate`` choices) and the variables of a run of N simulated replicas. What the
simulation does inside the replicas (their collectives) is
:mod:`colab_xla.runtimes.cpu_sim`."""

from __future__ import annotations

from typing import Dict

# How CPU replicas simulate a TPU host: one process per replica (as on TPU v4 and later),
# or threads of one process (as on TPU v2/v3).
SIMULATIONS = ("processes", "threads")
DEFAULT_SIMULATION = SIMULATIONS[0]


def environment(replicas: int, *, simulation: str = DEFAULT_SIMULATION,
                thread_pool_set: bool = False, param_aliasing_set: bool = False) -> Dict[str, str]:
    """The variables of a run of ``replicas`` CPU replicas (those the user set stay theirs)."""
    processes = simulation == "processes" and replicas > 1
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1" if processes else str(replicas)}
    if replicas > 1 and not param_aliasing_set:
        # A collective runs as a program of its own (see install; between processes, on
        # CPU copies): with parameter buffers donated to the step that updates them, a
        # training loop that never calls torch_xla.sync() after xm.optimizer_step meets
        # a deleted buffer at its second step.
        env["XLA_ENABLE_PARAM_ALIASING"] = "0"
    if processes:
        return env
    if not thread_pool_set:
        # A collective blocks one XLA pool thread per replica until all have arrived:
        # fewer threads than replicas (the default is the core count) hangs.
        env["XLA_THREAD_POOL_SIZE"] = str(max(replicas + 2, 8))
    return env
