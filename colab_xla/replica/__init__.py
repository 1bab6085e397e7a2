"""What runs inside each replica.

* :mod:`.entry`: what the launcher runs (the notebook's one way in): ``main(index, job)``
  for a one-off run's replica, ``serve`` for a session's (:mod:`.serve`).
* :mod:`.execution`: the cell run as replica ``index`` and its report,
  in the replica's own globals: the notebook's names (every one, inherited through fork;
  with spawn or a forkserver, those the cell mentions, sent with cloudpickle) and
  ``index`` (the ordinal), ``device`` (its XLA device, made on first use), ``lock`` (shared
  by all replicas, when the cell names it) and ``get_ipython``.
* :mod:`.process`: the set-up of a replica process, once per run; its runtime's part
  (:mod:`colab_xla.runtimes`; torch_xla's in :mod:`.torch_xla_process`, with the CPU
  simulation's :mod:`.cpu_sim`, :mod:`.shm_collectives` and :mod:`.gloo_collectives`).
* :mod:`.capture`: its standard streams (output to the notebook, no input).
* :mod:`.thread`: which replica the calling thread runs. On CPU, and on TPU v2/v3,
  several replicas are threads of one process, so output is routed by thread.

Nothing here runs in the notebook's process, except :func:`.process.inherit` around the
start of forked replicas (through :mod:`.entry`).
"""
