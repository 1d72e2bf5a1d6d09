"""Wall-clock time per phase of one optimizer step: `StepTimer`.

Owns the sums of each named phase (forward, backward, step, ...) since the last optimizer
step, and the breakdown of the last finished one. It does not decide what is timed or when
a breakdown is logged: the engine does (`wall_clock_breakdown`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class StepTimer:
    """Sums of named phases over one optimizer step. Disabled, every call is a no-op.

    `synchronize` (the accelerator's) runs at both ends of a timed phase, so device work
    queued inside it is counted in it and device work queued before it is not.
    """

    def __init__(self, *, enabled: bool, synchronize: Callable[[], None]) -> None:
        self.enabled = enabled
        self._synchronize = synchronize
        self._sums: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        self.last: dict[str, float] = {}
        """Seconds per phase of the last finished optimizer step ({} while disabled)."""

    def start(self) -> float:
        """A start mark for `stop` (0.0 while disabled)."""
        if not self.enabled:
            return 0.0
        self._synchronize()
        return time.perf_counter()

    def stop(self, name: str, start: float) -> None:
        """Add the time since `start` to phase `name`."""
        if self.enabled:
            self._synchronize()
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` measured elsewhere (e.g. the optimizer's own parts) to `name`."""
        if self.enabled:
            self._sums[name] = self._sums.get(name, 0.0) + seconds

    def add_total(self, name: str, total_s: float) -> None:
        """Add what a running total of seconds (a wait counter kept elsewhere) grew by since
        the last call for `name`."""
        if self.enabled:
            self.add(name, total_s - self._totals.get(name, 0.0))
            self._totals[name] = total_s

    def discard(self) -> None:
        """Drop what was timed since the last `finish` (running totals stay as they are)."""
        self._sums = {}

    def finish(self) -> dict[str, float]:
        """End the optimizer step: its sums become `last` and the next step starts at 0."""
        if self.enabled:
            self.last, self._sums = self._sums, {}
        return self.last


def format_breakdown(seconds: dict[str, float]) -> str:
    """ "forward 12.3 ms | backward 30.1 ms | ..." in the order the phases were first timed."""
    return " | ".join(f"{name} {s * 1e3:.1f} ms" for name, s in seconds.items())
