"""Where a cell runs: a one-off run on this machine, a session, every host of a cluster,
or the cluster's session."""
