"""Wall-clock time per phase of one optimizer step: `StepTimer`.

Owns the sums of each named phase (forward, backward, optimizer) since the last optimizer
step, the start of the step's window (its first timed phase), and the sums of the last
finished step. It does not decide what is timed, or whether the device is synchronized for
exact device times: the engine does (`wall_clock_breakdown`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class StepTimer:
    """Sums of named phases over one optimizer step: a `perf_counter` pair per phase.

    With `synchronize` (the accelerator's, when exact device times are asked for) it runs at
    both ends of a timed phase, so device work queued inside it is counted in it and device
    work queued before it is not. Without it, a phase is the host's time in it: on a GPU,
    work it queued may still be running when it ends.
    """

    def __init__(self, *, synchronize: Callable[[], None] | None = None) -> None:
        self._synchronize = synchronize
        self._sums: dict[str, float] = {}
        self._window_start: float | None = None
        self.last: dict[str, float] = {}
        """Seconds per phase of the last finished optimizer step."""
        self.last_window_s = 0.0
        """Seconds from the start of the last step's first timed phase to its `finish`."""

    @property
    def synchronizes(self) -> bool:
        return self._synchronize is not None

    def start(self) -> float:
        """A start mark for `stop`; the first of a step also opens the step's window."""
        if self._synchronize is not None:
            self._synchronize()
        now = time.perf_counter()
        if self._window_start is None:
            self._window_start = now
        return now

    def stop(self, name: str, start: float) -> None:
        """Add the time since `start` to phase `name`."""
        if self._synchronize is not None:
            self._synchronize()
        self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add `seconds` measured elsewhere to `name`."""
        self._sums[name] = self._sums.get(name, 0.0) + seconds

    def finish(self) -> dict[str, float]:
        """End the optimizer step: its sums become `last` and the next step starts at 0."""
        now = time.perf_counter()
        start = now if self._window_start is None else self._window_start
        self.last, self._sums = self._sums, {}
        self.last_window_s = now - start
        self._window_start = None
        return self.last
