"""Stands in for the ``rfc3987_syntax`` package in a local cluster's Ray processes: see the
package's docstring."""

raise ImportError("rfc3987_syntax is left out of this local Ray cluster's processes "
                  "(colab_xla.notebook.cluster.lean_imports)")
