"""Imported first by the forkserver colab_xla starts (its preload list), and nowhere else:
it makes the forkserver die with the notebook's process.

multiprocessing's forkserver exits when every holder of its "alive" pipe is gone, but it
hands that pipe to each process it forks, so its replicas keep it alive while they wait
for it to die (each replica dies with its parent, the forkserver): after a kernel is
SIGKILLed, neither would ever end. Here the forkserver itself dies with the notebook's
process (Linux parent-death signal), and its replicas die with it.
"""

import os

from ..wire.job import NOTEBOOK_PID  # set by launch.warm_forkserver for the server only
from ..wire.lifetime import die_with_parent

if NOTEBOOK_PID in os.environ:
    die_with_parent(int(os.environ.pop(NOTEBOOK_PID)))
