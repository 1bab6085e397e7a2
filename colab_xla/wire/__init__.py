"""What crosses between the notebook's process and the replicas, and how.

* :mod:`.frames`: one named pipe per run, written by every replica process; output
  lines and events (a replica started, ended, entered ``xm.rendezvous``, called
  ``os._exit``) as frames of at most ``PIPE_BUF`` bytes, so they never interleave.
* :mod:`.values`: a replica's report (its value, ``--pull`` names, error, time) pickled
  for the notebook, XLA tensors moved to CPU; written to a file of the run's private
  directory and announced by the replica's end frame (values can be gigabytes: a pipe
  the notebook drains line by line is no place for them).
* :mod:`.shared_tensors`: CPU tensors of 1 MiB or more inside a value, through files in
  ``/dev/shm`` the notebook maps instead of copying.
* :mod:`.names`: the notebook names a cell uses, sent with cloudpickle to replicas that
  do not fork (with fork they are inherited).
"""
