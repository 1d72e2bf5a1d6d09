"""`PhaseClock`: seconds per named phase of a one-off sequence (a run's start).

Owns the laps and their one-line description; not the step's timing (`step_timer`).
"""

from __future__ import annotations

import time


class PhaseClock:
    """Seconds each phase took, in order: `lap(name)` ends the phase begun at the last lap
    (or at construction)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        """ "2.50 s (data 0.01 s, model 1.49 s, ...)"."""
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        return f"{self.total_s:.2f} s ({parts})"
