"""The notebook's side: everything that runs in the notebook's process (and, on a cluster,
in each host's agent, which stands in for the notebook there).

* the magics (:mod:`.magics`), thin glue over the rest, and the options they take
  (:mod:`.options`);
* where a cell runs (:mod:`.targets`: a one-off run, a session, a cluster, a cluster's
  session) and the request it runs (:mod:`.request`, :mod:`.defaults`);
* the plan's inputs and the checks before a start (:mod:`.hardware`, :mod:`.preflight`,
  :mod:`.tpu_holders`, :mod:`.doctor`), the launcher (:mod:`.launch`, the only way into
  :mod:`colab_xla.replica`), and a run's supervision (:mod:`.supervisor` and its parts);
* what a person sees (:mod:`.outcome`, :mod:`.views`).

Nothing here runs in a replica.
"""
