"""Found first on the path of a local cluster's Ray processes, in place of the
``rfc3987_syntax`` package (:func:`colab_xla.notebook.cluster.local.ray_environment`).

jsonschema, which Ray imports, imports that package when it is installed (Jupyter's
``jsonschema[format-nongpl]`` brings it) to check the "iri" format, and it builds a Lark
grammar when imported: most of ``import ray``'s CPU, paid by each of Ray's Python processes.
A raylet aborts when its dashboard agent has not written its port within 15 s, a constant of
Ray's, and on a loaded machine that import can make it miss that. This file refuses to be
imported, which jsonschema takes as "no iri format": nothing of Ray's checks one. It is a
data file of colab_xla (this folder is no package), never a module of it.
"""

raise ImportError(
    "rfc3987_syntax is left out of a local Ray cluster's processes, which start faster without "
    "it (colab_xla/notebook/cluster/lean_imports); a cell that needs it can take that folder "
    "off its path first: sys.path[:] = [p for p in sys.path if not p.endswith('lean_imports')]")
