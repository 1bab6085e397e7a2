"""How a run ended (colab_xla.notebook.endings): XLA's fatal lines in a crashed process."""

import pytest

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


@pytest.mark.parametrize("line", [
    "2026-11-23 10:16:28.249609: F external/xla/xla/parse_flags_from_env.cc:234] Unknown flag",
    "F1123 10:16:28.249609    1234 pjrt_client.cc:99] Unknown flag",
])
def test_xla_fatal_lines_are_found_in_a_crashed_process_output(line):
    from colab_xla.notebook.output_log import OutputLog
    from colab_xla.notebook.endings import native_crash

    log = OutputLog(None)
    log.write("stderr", f"some output\n{line}\nFatal Python error: Aborted\n\nThread 0x1:\n")
    assert native_crash([log]) == ("SIGABRT", "Unknown flag")
    quiet = OutputLog(None)
    quiet.write("stdout", "F is a letter: nothing fatal] here\n")
    assert native_crash([quiet]) is None
