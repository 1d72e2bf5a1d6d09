"""The optimizer's parameter groups: each group's parameters step exactly as a one-group
optimizer with that group's hyperparameters and lr would step them, in the 32-bit and the
8-bit state, with groups that share a sub-group."""

from __future__ import annotations

import pytest
import torch

from infinity.config import OptimizerConfig, ZeroConfig
from infinity.optim import ParamGroup
from infinity.zero import PartitionedOptimizer, Slot

NUMELS = {"a": 3000, "b": 700, "c": 4100}  # unaligned; all three in one 16384 sub-group
GROUPS = [  # (names, betas, eps, weight_decay, lr)
    (("a",), (0.9, 0.999), 1e-8, 0.1, 1e-2),
    (("b", "c"), (0.8, 0.95), 1e-6, 0.0, 3e-3),
]


def _slots(names):
    seeds = {n: torch.Generator().manual_seed(k) for k, n in enumerate(NUMELS)}
    return [Slot(n, NUMELS[n], torch.randn(NUMELS[n], generator=seeds[n])) for n in names]


def _opt(names, kind, groups=(), **hyper):
    cfg = OptimizerConfig(type=kind, **hyper)
    return PartitionedOptimizer(
        _slots(names), optimizer=cfg, zero=ZeroConfig(sub_group_size=16384), groups=groups
    )


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(k, generator=g) for n, k in NUMELS.items()}


@pytest.mark.parametrize("kind", ["AdamW", "AdamW8bit"])
def test_each_group_steps_as_its_own_optimizer_bitwise(kind):
    names = list(NUMELS)
    groups = [ParamGroup.of(n, betas=b, eps=e, weight_decay=w) for n, b, e, w, _ in GROUPS]
    opt = _opt(names, kind, groups)
    alone = [
        (ns, lr, _opt(list(ns), kind, betas=b, eps=e, weight_decay=w)) for ns, b, e, w, lr in GROUPS
    ]
    for step in range(4):
        grads = _grads(step)
        scale = 0.5**step  # a schedule: each group's lr changes, each by its own
        for i, n in enumerate(names):
            opt.accumulate_grad(i, grads[n])
        opt.step(lr=[lr * scale for *_, lr in GROUPS])
        for ns, lr, ref in alone:
            for i, n in enumerate(ns):
                ref.accumulate_grad(i, grads[n])
            ref.step(lr=lr * scale)
    for ns, _, ref in alone:
        for i, n in enumerate(ns):
            assert torch.equal(opt.home(names.index(n)), ref.home(i)), (kind, n)


def test_one_group_steps_with_the_same_bits_as_no_groups():
    names = list(NUMELS)
    plain = _opt(names, "AdamW", weight_decay=0.1)
    grouped = _opt(names, "AdamW", [ParamGroup.of(names)], weight_decay=0.1)
    for step in range(3):
        for opt in (plain, grouped):
            for i, n in enumerate(names):
                opt.accumulate_grad(i, _grads(step)[n])
        plain.step(lr=1e-2)
        grouped.step(lr=[1e-2])
    for i in range(len(names)):
        assert torch.equal(plain.home(i), grouped.home(i))


def test_bad_groups_and_lrs_are_named():
    names = list(NUMELS)
    with pytest.raises(ValueError, match=r"\['c'\] are in no parameter group"):
        _opt(names, "AdamW", [ParamGroup.of(["a", "b"])])
    with pytest.raises(ValueError, match="'a' is in parameter groups 0 and 1"):
        _opt(names, "AdamW", [ParamGroup.of(["a", "b", "c"]), ParamGroup.of(["a"])])
    with pytest.raises(ValueError, match="betas must be two values"):
        _opt(names, "AdamW", [ParamGroup.of(names, betas=(0.9, 1.5))])
    opt = _opt(names, "AdamW", [ParamGroup.of(["a"]), ParamGroup.of(["b", "c"])])
    with pytest.raises(ValueError, match=r"lr has 3 values .* 2 parameter groups"):
        opt.step(lr=[1e-3, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="lr must be finite and >= 0, got -1.0"):
        opt.step(lr=[1e-3, -1.0])
    saved = opt.state_dict()
    other = _opt(names, "AdamW", [ParamGroup.of(["a"], eps=1e-6), ParamGroup.of(["b", "c"])])
    with pytest.raises(ValueError, match="resume with the same parameter groups"):
        other.load_state_dict(saved)
