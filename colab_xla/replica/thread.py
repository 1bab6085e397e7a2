"""Which replica the calling thread runs.

On CPU (and TPU v2/v3) several replicas are threads of one process: whatever routes by
replica (output lines, notes, the in-memory rendezvous of CPU replicas) asks here.
``current.ordinal`` is the replica's ordinal in its own thread, None elsewhere (a thread
the cell started, a pool's helper thread).
"""

import threading

class _Current(threading.local):
    ordinal = None  # (a class default: reading it in a thread that set none is fast)
    # A session replica's last cell's exception, and the cell's file (for %xla_debug).
    failure = None


current = _Current()
