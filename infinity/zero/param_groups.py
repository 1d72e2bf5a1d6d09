"""Which hyperparameters step which elements: the optimizer's parameter groups over its slots.

Owns the map from slots to step groups (the configured record, the record without weight
decay for `no_decay` slots, or one record per `ParamGroup`), the lr each group takes from a
step's lr (one for all, or one per parameter group), and the runs of a sub-group that one
record steps. It owns no buffers and no state.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from infinity.optim import AdamHyper
from infinity.optim.groups import ParamGroup
from infinity.zero.sub_groups import FlatLayout


@dataclass(frozen=True, slots=True)
class StepGroups:
    """Slot i is stepped with `hypers[of_slot[i]]` at the lr `lr_of[of_slot[i]]` of a step."""

    of_slot: tuple[int, ...]
    hypers: tuple[AdamHyper, ...]
    """Each step group's record (its lr is replaced at each step)."""
    lr_of: tuple[int, ...]
    """Each step group's index into a step's per-group lrs."""
    num_lrs: int
    """How many lrs a step may give (one per parameter group; 1 without groups)."""

    def at(self, lr: float | Sequence[float]) -> tuple[AdamHyper, ...]:
        """Each step group's record at the step's `lr` (one value, or one per group)."""
        lrs = check_lrs(lr, self.num_lrs)
        return tuple(h.with_lr(lrs[k]) for h, k in zip(self.hypers, self.lr_of, strict=True))

    def constants(self) -> list[dict] | None:
        """The parameter groups' records (lr aside), JSON-able; None without groups."""
        return [h.constants() for h in self.hypers] if self.num_lrs > 1 else None


def step_groups(
    base: AdamHyper, names: Sequence[str], no_decay: Collection[int], groups: Sequence[ParamGroup]
) -> StepGroups:
    """The step groups of slots `names`: with `groups`, one per group (every slot in exactly
    one); without, the configured record and (for `no_decay` slots) the one without decay."""
    if not groups:
        of_slot = tuple(1 if i in no_decay else 0 for i in range(len(names)))
        return StepGroups(of_slot, (base, base.without_decay()), (0, 0), 1)
    if no_decay:
        raise ValueError(
            "pass either no_decay or parameter groups, not both: give the no-decay "
            "parameters a group with weight_decay 0"
        )
    where: dict[str, int] = {}
    for k, group in enumerate(groups):
        for name in group.names:
            if name in where:
                raise ValueError(
                    f"parameter {name!r} is in parameter groups {where[name]} and {k}; put "
                    "each parameter in one group"
                )
            where[name] = k
    missing = [n for n in names if n not in where]
    if missing:
        raise ValueError(
            f"trainable parameters {missing[:5]} are in no parameter group; add them to a "
            "group or set requires_grad=False"
        )
    hypers = tuple(g.hyper(base) for g in groups)
    return StepGroups(
        tuple(where[n] for n in names), hypers, tuple(range(len(groups))), len(groups)
    )


def check_lrs(lr: float | Sequence[float], count: int) -> tuple[float, ...]:
    """`lr` as `count` learning rates (one value stands for all); errors name the value."""
    many = isinstance(lr, Sequence) and not isinstance(lr, str)
    lrs = tuple(lr) if many else (lr,) * count
    if len(lrs) == 1 and count > 1:
        lrs = lrs * count
    if len(lrs) != count:
        raise ValueError(
            f"lr has {len(lrs)} values ({list(lrs)}) but the optimizer has {count} parameter "
            "groups; give one lr, or one per group"
        )
    for value in lrs:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"lr must be a real number, got {value!r}")
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"lr must be finite and >= 0, got {value}; check the schedule")
    return tuple(float(v) for v in lrs)


def group_runs(layout: FlatLayout, g: int, of_slot: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, stop, step group) ranges of sub-group g in sub-group-local elements, adjacent
    slots of the same step group merged (with the zero padding between them, which stays zero
    under any Adam step), so the step runs one pass per run (one in the common case). A run
    starts at a slot or at the sub-group's start: on an 8-bit block."""
    base = layout.range(g)[0]
    runs: list[tuple[int, int, int]] = []
    for slot, a, b in layout.pieces(g):
        start, stop = layout.offsets[slot] + a - base, layout.offsets[slot] + b - base
        k = of_slot[slot]
        if runs and runs[-1][2] == k:
            runs[-1] = (runs[-1][0], stop, k)
        else:
            runs.append((start, stop, k))
    return runs
