"""How the partitioned optimizer sees the parameters: slots, their checks, and sub-groups.

Owns the `Slot` record (one trainable parameter's partition), the validation of a slot list
(errors name the slot and the fix), and the flat layout of the slots cut into sub-groups of
`sub_group_size` elements, the unit of one CPU-Adam pass and of one state swap. It owns no
buffers: `infinity.zero.optimizer` allocates them from the `FlatLayout` made here.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infinity.config import ZeroConfig

SLOT_ALIGN = 2048
"""Slots start on multiples of this many elements in the flat space (see FlatLayout)."""
MODEL_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True, slots=True)
class Slot:
    """One trainable parameter as the optimizer sees it."""

    name: str
    """The parameter's name, e.g. "layers.3.mlp.up_proj.weight" (unique)."""
    numel: int
    """Elements of this rank's partition."""
    partition: torch.Tensor
    """1-D contiguous host tensor in the model dtype (fp32/fp16/bf16): the weights."""


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """The slots laid out in one flat element space, cut into sub-groups.

    [Note: the flat space] Slot i occupies elements [offsets[i], offsets[i] + numels[i]);
    every slot starts on a multiple of `SLOT_ALIGN` elements (a 4 KiB boundary for 2- and
    4-byte dtypes, so a slot's 16-bit weights can be read from disk with O_DIRECT) and the
    gaps are zero padding. Sub-group g is the range [g * sub_group_size, (g + 1) *
    sub_group_size) of that space (the last one shorter): a large slot is split across
    sub-groups instead of making one oversized sub-group, so every swap buffer is the same
    size whatever the largest parameter.
    """

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    total: int
    """Elements of the whole space, padding included (a multiple of SLOT_ALIGN)."""
    sub_group_size: int
    """Elements per sub-group (a multiple of SLOT_ALIGN)."""

    @property
    def num_sub_groups(self) -> int:
        return -(-self.total // self.sub_group_size)

    def range(self, g: int) -> tuple[int, int]:
        """Flat [start, stop) of sub-group g."""
        start = g * self.sub_group_size
        return start, min(start + self.sub_group_size, self.total)

    @property
    def sub_group_numels(self) -> list[int]:
        return [b - a for a, b in map(self.range, range(self.num_sub_groups))]

    def pieces(self, g: int) -> list[tuple[int, int, int]]:
        """(slot, start, stop) for each slot overlapping sub-group g: [start, stop) is the
        overlap in slot-local elements (its flat place is offsets[slot] + start)."""
        lo, hi = self.range(g)
        first = bisect.bisect_right(self.offsets, lo) - 1
        out = []
        for i in range(max(first, 0), len(self.offsets)):
            off, n = self.offsets[i], self.numels[i]
            if off >= hi:
                break
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((i, a - off, b - off))
        return out

    def sub_groups_of(self, slot: int) -> range:
        """The sub-groups slot `slot` overlaps (empty for an empty slot)."""
        off, n = self.offsets[slot], self.numels[slot]
        if n == 0:
            return range(0)
        return range(off // self.sub_group_size, (off + n - 1) // self.sub_group_size + 1)

    def slots_within(self, count: int) -> frozenset[int]:
        """The slots that lie wholly in the first `count` sub-groups (an empty one counts as
        there when `count` > 0): those whose gradient sums `DeviceGradTier` keeps when it holds
        those sub-groups."""
        if count <= 0:
            return frozenset()
        return frozenset(
            i for i in range(len(self.numels)) if all(g < count for g in self.sub_groups_of(i))
        )


def aligned_sub_group_size(value: int) -> int:
    """`zero.sub_group_size` (resolved: `infinity.config.resolve_run` settles "auto") rounded
    up to a multiple of SLOT_ALIGN."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"zero_optimization.sub_group_size must be a positive int, got {value!r}; "
            "resolve the config first (infinity.config.resolve_run)"
        )
    return _align(value)


def _align(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


def check_slots(slots: Sequence[Slot]) -> torch.dtype | None:
    """Raises TypeError/ValueError naming the first bad slot; returns the model dtype (None if
    there are no slots)."""
    seen: dict[str, int] = {}
    dtype = None
    for i, slot in enumerate(slots):
        if not isinstance(slot, Slot):
            raise TypeError(f"slot {i} is a {type(slot).__name__}; pass infinity.zero.Slot records")
        where = f"slot {i} ({slot.name!r})"
        if not isinstance(slot.name, str) or not slot.name:
            raise ValueError(f"slot {i} has name {slot.name!r}; give every slot a non-empty name")
        if slot.name in seen:
            raise ValueError(
                f"{where}: the name is also slot {seen[slot.name]}'s; slot names must be unique "
                "(a tied weight is one slot)"
            )
        seen[slot.name] = i
        _check_partition(where, slot)
        if dtype is None:
            dtype = slot.partition.dtype
        elif slot.partition.dtype != dtype:
            raise TypeError(
                f"{where} has dtype {slot.partition.dtype} but slot 0 has {dtype}; every "
                "partition must be in the one model dtype"
            )
    return dtype


def _check_partition(where: str, slot: Slot) -> None:
    p = slot.partition
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where}: partition is a {type(p).__name__}, not a torch.Tensor")
    if p.dtype not in MODEL_DTYPES:
        allowed = ", ".join(str(d) for d in MODEL_DTYPES)
        raise TypeError(f"{where}: partition has dtype {p.dtype}; the optimizer takes {allowed}")
    if p.device.type != "cpu" or p.layout != torch.strided:
        raise ValueError(
            f"{where}: partition is a {p.layout} tensor on {p.device}; pass a dense host (CPU) "
            "tensor"
        )
    if p.dim() != 1 or not p.is_contiguous():
        raise ValueError(
            f"{where}: partition has shape {tuple(p.shape)} and strides {p.stride()}; pass the "
            "flat, contiguous partition (partition.reshape(-1) of a contiguous tensor)"
        )
    if isinstance(slot.numel, bool) or not isinstance(slot.numel, int) or slot.numel < 0:
        raise ValueError(f"{where}: numel must be an int >= 0, got {slot.numel!r}")
    if p.numel() != slot.numel:
        raise ValueError(
            f"{where}: numel is {slot.numel} but the partition has {p.numel()} elements; "
            "numel must be the partition's size"
        )


def flat_layout(numels: Sequence[int], sub_group_size: int) -> FlatLayout:
    """Slots in order, each on a SLOT_ALIGN boundary; sub-groups of `sub_group_size`
    elements (already resolved: a multiple of SLOT_ALIGN)."""
    if sub_group_size % SLOT_ALIGN:
        raise ValueError(f"sub_group_size {sub_group_size} is not a multiple of {SLOT_ALIGN}")
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += _align(n)
    return FlatLayout(tuple(offsets), tuple(numels), total, sub_group_size)


def optimizer_layout(slot_numels: Sequence[int], zero: ZeroConfig) -> FlatLayout:
    """The flat layout the optimizer will make of slots of `slot_numels`: to build its state
    tier (`sub_group_numels`) and weights (`make_weights`) before constructing it."""
    return flat_layout(slot_numels, aligned_sub_group_size(zero.sub_group_size))


def sub_group_numels(slot_numels: Sequence[int], zero: ZeroConfig) -> list[int]:
    """Elements of each sub-group the optimizer will make of slots of `slot_numels`: the
    `numels` to build a `StateTier` with before constructing the optimizer."""
    return optimizer_layout(slot_numels, zero).sub_group_numels
