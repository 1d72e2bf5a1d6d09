"""Argument checks of `PartitionedOptimizer` (`infinity.zero.optimizer`): the slots that
skip weight decay, a step's scalars, and a checkpoint's slots against the optimizer's. Each
error names the value and what to give instead."""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection


def check_no_decay(no_decay: Collection[int], num_slots: int) -> set[int]:
    bad = [i for i in no_decay if isinstance(i, bool) or not isinstance(i, int)]
    bad += [i for i in no_decay if isinstance(i, int) and not 0 <= i < num_slots]
    if bad:
        raise ValueError(
            f"no_decay holds {bad[:5]}, which are not slot indices (0..{num_slots - 1})"
        )
    return set(no_decay)


def check_step_args(lr: float, loss_scale: float, max_grad_norm: float) -> None:
    for name, value in (("lr", lr), ("loss_scale", loss_scale), ("max_grad_norm", max_grad_norm)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {value!r}")
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}; check the schedule")
    if not (math.isfinite(loss_scale) and loss_scale > 0.0):
        raise ValueError(f"loss_scale must be finite and > 0, got {loss_scale}; 1.0 disables it")
    if not max_grad_norm >= 0.0:
        raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {max_grad_norm}")


def check_same_slots(saved: list, names: list[str], numels: list[int]) -> None:
    for i, (entry, name, numel) in enumerate(zip(saved, names, numels, strict=False)):
        if list(entry) != [name, numel]:
            raise ValueError(
                f"the checkpoint's slot {i} is {entry[0]!r} ({entry[1]} elements) but this "
                f"optimizer's is {name!r} ({numel} elements); load it into the same model, "
                "the same trainable parameters and the same partitioning"
            )
    if len(saved) != len(names):
        raise ValueError(
            f"the checkpoint has {len(saved)} slots but this optimizer has {len(names)}; the "
            "first difference is at slot "
            f"{min(len(saved), len(names))}: load it into the same trainable parameters"
        )
