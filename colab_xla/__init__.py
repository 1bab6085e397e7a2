"""colab_xla: run a notebook cell on every PyTorch/XLA replica with ``%%xla_spawn``.

Load it in a notebook with ``%load_ext colab_xla``. The IPython glue is imported only
then, so the core (``colab_xla.notebook.targets`` and what it uses) imports without IPython.
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """Register ``%%xla_spawn``, ``%xla_session``, ``%xla_cluster``, ``%xla_debug``,
    ``%xla_doctor`` and ``%%xla_local`` (called by ``%load_ext colab_xla``)."""
    from .notebook import auto_cells, completer, targets
    from .notebook.defaults import Defaults
    from .notebook.magics import XlaMagics

    ipython.register_magics(XlaMagics)
    completer.install(ipython, targets.current_session)  # Tab: the replicas' names too
    auto_cells.install(ipython, targets.current_session)  # (%xla_session auto turns it on)
    if Defaults.read().start_method == "forkserver":
        from .notebook.launch import warm_forkserver

        warm_forkserver()  # it imports torch and torch_xla in the background meanwhile


def unload_ipython_extension(ipython):
    """Remove the magics, end the session and the cluster connection, and stop the lock
    manager (``%unload_ext colab_xla``)."""
    from .notebook import auto_cells, completer, shared_lock, targets

    completer.uninstall(ipython)
    auto_cells.uninstall(ipython)
    targets.stop_session()
    targets.stop_cluster()
    ipython.magics_manager.magics["cell"].pop("xla_spawn", None)
    ipython.magics_manager.magics["cell"].pop("xla_local", None)
    ipython.magics_manager.magics["line"].pop("xla_doctor", None)
    ipython.magics_manager.magics["line"].pop("xla_session", None)
    ipython.magics_manager.magics["line"].pop("xla_cluster", None)
    ipython.magics_manager.magics["line"].pop("xla_debug", None)
    ipython.magics_manager.registry.pop("XlaMagics", None)
    shared_lock.shutdown()
