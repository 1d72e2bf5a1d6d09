"""A gather unit: one module and the parameters it needs while it runs.

Its own parameters (`recurse=False`) plus any parameter seen used inside its forward that
belongs elsewhere (a tied `F.linear(x, self.embed.weight)`), learned on first use and
gathered with the module from then on. Units are the entries of the trace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infinity.zero.param import OffloadParam


class ModuleUnit:
    """One module's gather set. `records` is own + external, without duplicates."""

    __slots__ = ("name", "records", "numel", "_members")

    def __init__(self, name: str, own: list[OffloadParam]) -> None:
        self.name = name
        self.records: list[OffloadParam] = []
        self.numel = 0
        self._members: set[OffloadParam] = set()
        for rec in own:
            self.add(rec)

    def add(self, rec: OffloadParam) -> bool:
        """Add `rec` to the gather set; False if it was already there."""
        if rec in self._members:
            return False
        self._members.add(rec)
        self.records.append(rec)
        self.numel += rec.numel
        return True

    def __contains__(self, rec: OffloadParam) -> bool:
        return rec in self._members

    def __repr__(self) -> str:
        return f"ModuleUnit({self.name!r}, {len(self.records)} params, {self.numel} elements)"
