"""Which gathered parameter a tensor lives in: the lookup behind the saved-tensor hooks.

`GatheredIndex` maps the memory of every LIVE parameter's buffer to its record, so that a
tensor autograd saves (the weight, or a view of it such as `weight.t()`) is recognized as
a parameter's and stored by reference (see [Note: saved weights] in hooks.py). A buffer of
its own is found by its storage; an alias of a host home shares its storage with the other
homes in the same flat buffer (see [Note: gathered means resident] in param.py), so those
are found by address range within that storage. The coordinator keeps it current (`add`
when a parameter becomes LIVE, `remove` on release); it decides nothing.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infinity.zero.param import OffloadParam


class _Spans:
    """Aliased buffers in one shared storage, sorted by start address (disjoint, none
    empty)."""

    __slots__ = ("starts", "ends", "recs")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.recs: list[OffloadParam] = []

    def add(self, start: int, end: int, rec: OffloadParam) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.recs.insert(i, rec)

    def remove(self, start: int, rec: OffloadParam) -> None:
        i = bisect.bisect_left(self.starts, start)
        if i < len(self.recs) and self.recs[i] is rec:
            del self.starts[i], self.ends[i], self.recs[i]

    def find(self, address: int) -> OffloadParam | None:
        i = bisect.bisect_right(self.starts, address) - 1
        if i >= 0 and address < self.ends[i]:
            return self.recs[i]
        return None


class GatheredIndex:
    """LIVE parameters by the memory of their buffers."""

    __slots__ = ("_own", "_shared")

    def __init__(self) -> None:
        self._own: dict[int, OffloadParam] = {}
        """Storage address -> the parameter whose copied buffer it is."""
        self._shared: dict[int, _Spans] = {}
        """Storage address of a flat host buffer -> the parameters aliasing ranges of it."""

    def __bool__(self) -> bool:
        return bool(self._own) or bool(self._shared)

    def add(self, rec: OffloadParam) -> None:
        buf = rec.device_tensor
        assert buf is not None
        storage = buf.untyped_storage().data_ptr()
        if rec.aliased:
            if not buf.numel():  # no memory to find (its address may be a neighbour's)
                return
            spans = self._shared.get(storage)
            if spans is None:
                spans = self._shared[storage] = _Spans()
            spans.add(buf.data_ptr(), buf.data_ptr() + buf.nbytes, rec)
        else:
            self._own[storage] = rec

    def remove(self, rec: OffloadParam) -> None:
        buf = rec.device_tensor
        if buf is None:
            return
        storage = buf.untyped_storage().data_ptr()
        if rec.aliased:
            spans = self._shared.get(storage)
            if spans is not None and buf.numel():
                spans.remove(buf.data_ptr(), rec)
                if not spans.recs:
                    del self._shared[storage]
        elif self._own.get(storage) is rec:
            del self._own[storage]

    def find(self, t: torch.Tensor) -> OffloadParam | None:
        """The LIVE parameter whose buffer `t` lies in (None: not a gathered weight)."""
        storage = t.untyped_storage().data_ptr()
        rec = self._own.get(storage)
        if rec is not None:
            return rec
        spans = self._shared.get(storage)
        return spans.find(t.data_ptr()) if spans is not None else None
