"""Argument checks of `PartitionedOptimizer` (`infinity.zero.optimizer`): the slots that
skip weight decay, a step's scalars, a checkpoint's slots against the optimizer's, the
weights' layout against the slots', the state tier against the sub-groups and the config's
hyperparameters. Each error names the
value and what to give instead."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from infinity.config import OptimizerConfig, check_resolved
from infinity.optim import AdamHyper
from infinity.swap.grad_tier import GradTier, HostGradTier
from infinity.swap.state_tier import HostStateTier, StateFormat, StateTier
from infinity.zero.sub_groups import FlatLayout, flat_layout

if TYPE_CHECKING:
    from infinity.zero.weights import HostWeights, NvmeWeights

logger = logging.getLogger("infinity.zero.optimizer")


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


def check_groups(saved: list | None, groups: list | None) -> None:
    """Refuses a checkpoint whose parameter groups' hyperparameters differ from these: the
    moments were made under them, and a group is known by its place only."""
    if saved != groups:
        raise ValueError(
            f"the checkpoint's optimizer parameter groups are {saved} but this optimizer's are "
            f"{groups}; resume with the same parameter groups (betas, eps, weight_decay per "
            "group, in the same order)"
        )


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


def check_layout(
    weights: HostWeights | NvmeWeights | None, numels: list[int], sub_group_size: int
) -> FlatLayout:
    """The flat layout of slots of `numels`: the one `weights` (and so the homes) were made
    with, computed once by whoever built them, or a new one without weights."""
    if weights is None:
        return flat_layout(numels, sub_group_size)
    layout = weights.layout
    if list(layout.numels) != numels or layout.sub_group_size != sub_group_size:
        raise ValueError(
            "the weights were made for another flat layout than these slots'; build them "
            "with make_weights(optimizer_layout(...), ...) from the same slots and config"
        )
    return layout


def hyperparameters(cfg: OptimizerConfig) -> AdamHyper:
    """The config's hyperparameters, at lr 0: `step` puts in the scheduled lr (with_lr)."""
    check_resolved(cfg, "optimizer.params")
    values = {"betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    try:
        modes = {"adamw_mode": cfg.adamw_mode, "bias_correction": cfg.bias_correction}
        return AdamHyper.of(lr=0.0, **values, **modes)
    except (TypeError, ValueError) as e:
        raise type(e)(f"optimizer.params.{e}") from None


def check_state_dict(
    d: dict, kind: str, version: int, names: Sequence[str], numels: Sequence[int], hyper: dict
) -> None:
    """A saved optimizer state dict against this optimizer: its kind, version and slots;
    hyperparameters that differ from the configured `hyper` (which stay) are logged."""
    if not isinstance(d, dict) or d.get("kind") != kind:
        raise ValueError(f"not a {kind} state dict: {str(d)[:120]}")
    if d.get("version", 0) > version:
        raise ValueError(f"state dict version {d['version']} is newer than {version}")
    check_same_slots(d["slots"], names, numels)
    for key, saved in d.get("hyperparameters", {}).items():
        if hyper.get(key) != saved:
            logger.warning(
                "optimizer %s was %r in the checkpoint and is %r now; using %r",
                key, saved, hyper.get(key), hyper.get(key),
            )  # fmt: skip


def check_state_tier(
    tier: StateTier | None, numels: list[int], fmt: StateFormat, sub_group_size: int
) -> StateTier:
    """`tier` once checked against the sub-groups and the state format (a host tier when
    None)."""
    if tier is None:
        return HostStateTier(numels, fmt)
    if getattr(tier, "format", StateFormat.ADAMW) is not fmt:
        raise ValueError(
            f"the state tier holds {tier.format.value} state but the optimizer is "
            f"{fmt.value}; build it with make_state_tier(..., fmt=...) of the same optimizer "
            "config"
        )
    if list(tier.numels) != numels:
        raise ValueError(
            f"the state tier holds sub-groups of {list(tier.numels)} elements but these "
            f"slots make {numels} (sub_group_size={sub_group_size}); build the tier with "
            "infinity.zero.sub_group_numels(...)"
        )
    return tier


def check_grad_tier(grad_tier: GradTier | None, numels: list[int]) -> GradTier:
    """`grad_tier`, or a host tier of `numels` when None; refused when it is no `GradTier`
    or its sub-groups differ."""
    if grad_tier is None:
        return HostGradTier(numels)
    if not isinstance(grad_tier, GradTier):
        raise TypeError(
            f"grad_tier: expected a GradTier (infinity.swap.grad_tier), got "
            f"{type(grad_tier).__name__}; build one with infinity.swap.make_grad_tier(...)"
        )
    if list(grad_tier.numels) != numels:
        raise ValueError(
            f"the gradient tier holds sub-groups of {list(grad_tier.numels)} elements but "
            f"these slots make {numels}; build it with infinity.zero.sub_group_numels(...)"
        )
    return grad_tier
