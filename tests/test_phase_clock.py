"""PhaseClock: laps in order, a repeated phase adds up, one-line description."""

from __future__ import annotations

import time

from infinity.utils.phase_clock import PhaseClock


def test_laps_in_order_and_repeated_phase_adds_up():
    clock = PhaseClock()
    time.sleep(0.01)
    clock.lap("a")
    clock.lap("b")
    time.sleep(0.01)
    clock.lap("a")
    assert list(clock.seconds) == ["a", "b"]
    assert clock.seconds["a"] >= 0.02 > clock.seconds["b"] >= 0
    assert clock.total_s == sum(clock.seconds.values())
    text = clock.describe()
    assert text.startswith(f"{clock.total_s:.2f} s (a ") and ", b " in text
