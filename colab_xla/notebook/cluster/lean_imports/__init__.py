"""Modules that a local cluster's Ray processes find first on their path
(:func:`colab_xla.notebook.cluster.local.ray_environment`), in place of costly optional ones.

``rfc3987_syntax``: jsonschema imports it when it is installed (Jupyter's
``jsonschema[format-nongpl]`` brings it), to check the "iri" format, and it builds a Lark
grammar when imported: 2.1 s of CPU here, 70% of ``import ray``, paid by each of Ray's
Python processes (every node's agents and workers). A raylet aborts when its dashboard agent
has not written its port within 15 s, a constant of Ray's, and on a loaded 2-core machine
that import made it miss that (seen in this project's CI). The module here refuses to be
imported, which jsonschema takes as "no iri format": nothing of Ray's checks one.
"""
