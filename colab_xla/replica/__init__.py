"""What runs inside each replica.

* :mod:`.entry`: what the launcher runs (the notebook's one way in): ``main(index, job)``
  for a one-off run's replica, ``serve`` for a session's (:mod:`.serve`).
* :mod:`.execution`: the cell run as replica ``index`` and its report,
  in the replica's own globals: the notebook's names (every one, inherited through fork;
  with spawn or a forkserver, those the cell mentions, sent with cloudpickle) and
  ``index`` (the ordinal), ``device`` (its XLA device, made on first use), ``lock`` (shared
  by all replicas, when the cell names it) and ``get_ipython``.
* :mod:`.process`: the set-up of a replica process, once per run; its runtime's part
  (:mod:`colab_xla.runtimes`, which also holds what the runtimes' replica halves use:
  torch_xla's :mod:`colab_xla.runtimes.torch_xla_process`, the CPU simulation's
  collectives, :mod:`colab_xla.runtimes.thread`).
* :mod:`.capture`: its standard streams (output to the notebook, no input), routed by
  thread (:mod:`colab_xla.runtimes.thread`): on CPU, and on TPU v2/v3, several replicas
  are threads of one process.

Nothing here runs in the notebook's process, except :func:`.process.inherit` around the
start of forked replicas (through :mod:`.entry`).
"""
