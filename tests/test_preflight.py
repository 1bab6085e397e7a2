"""The checks before a start (colab_xla.notebook.preflight): fork's hazards, torchrun."""

import threading

import pytest

from colab_xla.notebook import launch, preflight

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


@pytest.mark.parametrize("start_method, python, threads, cuda, codes", [
    ("fork", (3, 11), 4, False, []),
    ("fork", (3, 12), 4, False, ["fork-threads"]),
    ("fork", (3, 12), 0, False, []),  # only the kernel's threads
    ("fork", (3, 11), 0, True, ["fork-cuda"]),
    ("forkserver", (3, 13), 9, True, []),
    ("spawn", (3, 12), 9, True, []),
])
def test_fork_is_called_unsafe_when_it_is_and_the_safe_methods_named(start_method, python,
                                                                      threads, cuda, codes):
    found = preflight.launch_problems(launch.Launch(start_method), {}, python=python,
                                      threads=threads, cuda_initialized=cuda)
    assert [p.code for p in found] == codes
    assert all(not p.fatal and "--start-method forkserver" in p.fix for p in found)


def test_torch_xla_launch_under_torchrun_is_refused():
    found = preflight.launch_problems(launch.Launch(launcher="launch"),
                                      {"TORCHELASTIC_RUN_ID": "x"}, threads=0,
                                      cuda_initialized=False)
    assert [(p.code, p.fatal) for p in found] == [("torchelastic", True)]
    assert preflight.launch_problems(launch.Launch(), {"TORCHELASTIC_RUN_ID": "x"},
                                     threads=0, cuda_initialized=False) == []


def test_only_threads_other_than_the_kernels_count_against_fork():
    """On Python 3.12+ every kernel runs threads (ipykernel's): no reason to warn there."""
    import types

    kernels = types.ModuleType("ipykernel.fake")
    stop = threading.Event()

    def kernel_loop():
        stop.wait()

    kernel_loop.__module__ = kernels.__name__
    user = threading.Thread(target=stop.wait, name="a user's thread")
    kernel = threading.Thread(target=kernel_loop, name="IOPub")
    ours = threading.Thread(target=stop.wait, name="colab_xla-driver")
    for t in (user, kernel, ours):
        t.start()
    try:
        found = preflight.foreign_threads()
        assert user in found and kernel not in found and ours not in found
    finally:
        stop.set()
        for t in (user, kernel, ours):
            t.join()
