"""The execution order of one iteration (forward, then backward) as a list of gather units.

A `Trace` is recorded on the first iteration of each kind (training with gradients, or
inference) and replayed afterwards: the coordinator walks a cursor along it to prefetch ahead
and to decide whether a parameter is reused soon enough to keep. When an iteration gathers in
a different order, the recording of that iteration replaces the trace (it is updated, never
abandoned). It owns no tensors.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infinity.zero.param import OffloadParam
    from infinity.zero.unit import ModuleUnit


class Trace:
    """An immutable order of units with, per parameter, the positions that use it."""

    def __init__(self, units: Sequence[ModuleUnit]) -> None:
        self.units: list[ModuleUnit] = list(units)
        self.records: list[tuple[OffloadParam, ...]] = [tuple(u.records) for u in self.units]
        # cum[i] = elements gathered by positions [0, i): distances between uses.
        self.cum = [0]
        self.uses: dict[OffloadParam, list[int]] = {}
        for pos, recs in enumerate(self.records):
            self.cum.append(self.cum[-1] + sum(r.numel for r in recs))
            for r in recs:
                self.uses.setdefault(r, []).append(pos)

    def __len__(self) -> int:
        return len(self.units)

    def next_use(self, rec: OffloadParam, after: int) -> int | None:
        """The first position > `after` that uses `rec`, or None."""
        positions = self.uses.get(rec)
        if not positions:
            return None
        i = bisect.bisect_right(positions, after)
        return positions[i] if i < len(positions) else None

    def distance(self, start: int, stop: int) -> int:
        """Elements gathered by positions [start, stop)."""
        return self.cum[stop] - self.cum[start]

    def find(self, unit: ModuleUnit, start: int, window: int) -> int | None:
        """The position of `unit` in [start, start + window), or None."""
        for pos in range(start, min(start + window, len(self.units))):
            if self.units[pos] is unit:
                return pos
        return None

    def same_order(self, units: Sequence[ModuleUnit]) -> bool:
        return len(units) == len(self.units) and all(
            a is b for a, b in zip(units, self.units, strict=True)
        )
