"""When the views draw (colab_xla.notebook.draw_pacing)."""

import pytest

from colab_xla.notebook.draw_pacing import NEXT_DRAW_SECONDS, TICK_SECONDS, DrawPacer

pytestmark = [pytest.mark.quick, pytest.mark.stacks("colab", "kaggle")]


def test_output_is_drawn_at_once_and_without_output_every_tick():
    pacer = DrawPacer(now=0.0)
    assert pacer.due == TICK_SECONDS  # nothing to show: elapsed times, a tick later
    pacer.output(0.05)
    assert pacer.due == 0.05  # the first line: now, not at the tick
    pacer.drew(0.05)
    assert pacer.due == 0.05 + TICK_SECONDS


def test_a_flood_of_output_is_drawn_at_doubling_waits_up_to_a_tick():
    pacer, now, waits = DrawPacer(now=1.0), 1.0, []
    for _ in range(10):  # output comes right after every draw
        pacer.output(now + 0.0001)
        waits.append(round(pacer.due - now, 4))
        now = pacer.due
        pacer.drew(now)
    assert waits[:6] == [0.0001, 0.01, 0.02, 0.04, 0.08, 0.16]
    assert waits[6:] == [TICK_SECONDS] * 4


def test_output_that_comes_after_the_wait_is_drawn_at_once_and_resets_it():
    pacer = DrawPacer(now=1.0)
    for now in (1.0, 1.0005, 1.01):  # a flood: the wait grew to 40 ms
        pacer.output(now)
        pacer.drew(pacer.due)
    last = pacer.due - TICK_SECONDS
    pacer.output(last + 0.05)  # replicas starting one after another, 50 ms apart
    assert pacer.due == last + 0.05
    pacer.drew(last + 0.05)
    pacer.output(last + 0.0501)  # right after: waits the first interval again
    assert pacer.due == pytest.approx(last + 0.05 + NEXT_DRAW_SECONDS)
