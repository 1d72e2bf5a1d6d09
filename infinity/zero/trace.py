"""The execution order of one iteration (forward, then backward) as a list of gather units.

A `Trace` is recorded on the first iteration of each kind (training with gradients, or
inference) and replayed afterwards: the coordinator walks a cursor along it (`find`) and the
live-set planner (`infinity.zero.live_plan`) follows the same order as parameter indices
(`live`) to prefetch ahead and to decide whether a parameter is reused soon enough to keep.
When an iteration gathers in a different order, the recording of that iteration replaces the
trace (it is updated, never abandoned). It owns no tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from infinity.zero.live_plan import LiveTrace

if TYPE_CHECKING:
    from infinity.zero.param import OffloadParam
    from infinity.zero.unit import ModuleUnit


class Trace:
    """An immutable order of units, and the same order as the planner's `LiveTrace`."""

    def __init__(
        self,
        units: Sequence[ModuleUnit],
        index: Callable[[OffloadParam], int],
        numel: Sequence[int],
    ) -> None:
        """`index` maps a record to its planner index, `numel` gives each index's elements."""
        self.units: list[ModuleUnit] = list(units)
        ids = [[index(r) for r in u.records] for u in self.units]
        self.live = LiveTrace(ids, numel)
        """The same order as parameter indices, for the planner."""

    def __len__(self) -> int:
        return len(self.units)

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
