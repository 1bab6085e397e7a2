"""What detection reads (colab_xla.notebook.hardware)."""

import pytest

from colab_xla.notebook import hardware

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_detect_reads_the_environment_only():
    hw = hardware.detect({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "6"})
    assert hw == hardware.Hardware(pjrt_device="CPU", tpu_chips=0, cpu_num_devices=6)


@pytest.mark.parametrize("value, count, bad", [
    ("6", 6, None), (" 6 ", 6, None), ("", None, None),  # empty: not set
    ("abc", None, "abc"), ("0", None, "0"), ("-2", None, "-2"), ("2.5", None, "2.5"),
])
def test_detect_keeps_a_cpu_num_devices_that_is_not_a_count_to_refuse_it(value, count, bad):
    hw = hardware.detect({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": value})
    assert (hw.cpu_num_devices, hw.bad_cpu_num_devices) == (count, bad)
