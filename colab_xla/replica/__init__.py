"""What runs inside each replica.

* :mod:`.job`: the function xmp.spawn calls, ``main(index, job)``, and the cell it runs,
  in the replica's own globals: the notebook's names (every one, inherited through fork;
  with spawn or a forkserver, those the cell mentions, sent with cloudpickle) and
  ``index`` (the ordinal), ``device`` (its XLA device, made on first use), ``lock`` (shared
  by all replicas, when the cell names it) and ``get_ipython``.
* :mod:`.process`: the set-up of a replica process, once per run.
* :mod:`.capture`: its standard streams (output to the notebook, no input).
* :mod:`.thread`: which replica the calling thread runs. On CPU, and on TPU v2/v3,
  several replicas are threads of one process, so output is routed by thread.

Nothing here runs in the notebook's process, except :func:`.process.inherit` around the
start of forked replicas.
"""
