"""How the partitioned optimizer sees the parameters: slots, their checks, and sub-groups.

Owns the `Slot` record (one trainable parameter's partition), the validation of a slot list
(errors name the slot and the fix), and the packing of slots into sub-groups of at most
`sub_group_size` elements, the unit of one CPU-Adam pass and of one state swap. It owns no
buffers: `infinity.zero.optimizer` allocates them from the `SubGroupLayout` made here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infinity.config import AUTO

# DeepSpeed's default for zero_optimization.sub_group_size, used when it is still "auto".
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
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
class SubGroupLayout:
    """Slots `first` to `stop - 1`, packed back to back into one flat buffer of `numel`."""

    index: int
    first: int
    stop: int
    offsets: tuple[int, ...]
    """Start of each of the sub-group's slots inside its flat buffers."""
    numel: int


def resolve_sub_group_size(value: int | str) -> int:
    """`zero.sub_group_size` as an int: "auto" takes DeepSpeed's default (1e9 elements)."""
    if value == AUTO:
        return DEFAULT_SUB_GROUP_SIZE
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"zero_optimization.sub_group_size must be a positive int or 'auto', got {value!r}"
        )
    return value


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


def pack(numels: Sequence[int], sub_group_size: int) -> list[SubGroupLayout]:
    """Slots in order, a new sub-group whenever the next slot would pass `sub_group_size`
    (a slot larger than that is a sub-group alone; slots are never split)."""
    groups: list[SubGroupLayout] = []
    first, offsets, total = 0, [], 0
    for i, n in enumerate(numels):
        if offsets and n and total + n > sub_group_size:  # empty slots join the last
            groups.append(SubGroupLayout(len(groups), first, i, tuple(offsets), total))
            first, offsets, total = i, [], 0
        offsets.append(total)
        total += n
    if offsets:
        groups.append(SubGroupLayout(len(groups), first, len(numels), tuple(offsets), total))
    return groups


def decay_runs(
    layout: SubGroupLayout, numels: Sequence[int], no_decay: set[int]
) -> list[tuple[int, int, bool]]:
    """(start, stop, decays) element ranges of the sub-group, adjacent slots with the same
    weight-decay setting merged, so the step runs one pass per run (one in the common case)."""
    runs: list[tuple[int, int, bool]] = []
    for k, slot in enumerate(range(layout.first, layout.stop)):
        start, stop = layout.offsets[k], layout.offsets[k] + numels[slot]
        if stop == start:
            continue
        decays = slot not in no_decay
        if runs and runs[-1][2] == decays:
            runs[-1] = (runs[-1][0], stop, decays)
        else:
            runs.append((start, stop, decays))
    return runs
