"""Imported last by the forkserver colab_xla starts (its preload list), and nowhere else:
what each replica it forks would find out alone, found once in the server, which its
replicas inherit: the user's own modules (:func:`colab_xla.runtimes.bound_names.own_modules`,
which then reads only the modules a replica imports after)."""

from ..runtimes import bound_names

bound_names.own_modules()
