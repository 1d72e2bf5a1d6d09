"""LR schedules against DeepSpeed's formulas, written out independently here."""

from __future__ import annotations

import json
import math

import pytest

from infinity.config import SchedulerConfig
from infinity.optim.schedules import build_schedule


def _warmup_fraction(kind: str, applied: int, warmup: int) -> float:
    # After `applied` >= 1 applied steps DeepSpeed has stepped its scheduler applied times from
    # last_batch_iteration=-1, so its iteration is applied - 1.
    w = max(2, warmup)
    if kind == "log":
        return math.log(applied) / math.log(w)
    return (applied - 1) / w


def ref_warmup_lr(applied, *, lo, hi, warmup, kind, total=None):
    w = max(2, warmup)
    if applied == 0:
        return lo
    if applied - 1 < w:
        return lo + (hi - lo) * _warmup_fraction(kind, applied, warmup)
    if total is None:
        return hi
    remaining = total - (applied - 1)
    return lo + (hi - lo) * max(0.0, remaining / max(1, total - w))


def ref_cosine_lr(applied, *, lr, total, warmup, kind, start, floor):
    w = max(2, warmup)
    if applied == 0:
        return 0.0
    if applied - 1 < w:
        return lr * (start + (1 - start) * _warmup_fraction(kind, applied, warmup))
    progress = min(1.0, (applied - w) / max(1, total - w))
    return lr * (floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("warmup", [1, 2, 7, 50])
def test_warmup_lr(kind, warmup):
    params = dict(warmup_min_lr=1e-5, warmup_max_lr=3e-3, warmup_num_steps=warmup)
    sched = build_schedule(
        SchedulerConfig(type="WarmupLR", params={**params, "warmup_type": kind}), 1.0
    )
    for step in range(120):
        want = ref_warmup_lr(step, lo=1e-5, hi=3e-3, warmup=warmup, kind=kind)
        assert sched.lr_at(step) == pytest.approx(want, rel=1e-12, abs=1e-15), step
    assert sched.lr_at(10_000) == pytest.approx(3e-3)


def test_first_two_steps_use_min_lr_and_warmup_reaches_max():
    # DeepSpeed: the lr set at construction (iteration -1) and after the first step
    # (iteration 0, log(1) = 0) are both warmup_min_lr.
    sched = build_schedule(
        SchedulerConfig(type="WarmupLR", params={"warmup_num_steps": 10, "warmup_type": "linear"}),
        0.5,
    )
    assert [sched.lr_at(s) for s in (0, 1, 2)] == [0.0, 0.0, pytest.approx(0.05)]
    assert sched.lr_at(11) == 0.5  # warmup_max_lr defaults to the optimizer's lr
    assert sched.lr_at(10) == pytest.approx(0.45)


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("warmup,total", [(10, 10), (10, 37), (3, 100), (1, 5)])
def test_warmup_decay_lr(kind, warmup, total):
    params = dict(
        warmup_min_lr=0.0,
        warmup_max_lr=1e-3,
        warmup_num_steps=warmup,
        total_num_steps=total,
        warmup_type=kind,
    )
    sched = build_schedule(SchedulerConfig(type="WarmupDecayLR", params=params), 99.0)
    for step in range(total + 20):
        want = ref_warmup_lr(step, lo=0.0, hi=1e-3, warmup=warmup, kind=kind, total=total)
        assert sched.lr_at(step) == pytest.approx(want, rel=1e-12, abs=1e-15), step
    assert sched.lr_at(total + 1) == 0.0


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("warmup,total,start,floor", [(10, 40, 0.0, 1e-4), (5, 6, 0.2, 0.1)])
def test_warmup_cosine_lr(kind, warmup, total, start, floor):
    params = dict(
        total_num_steps=total,
        warmup_num_steps=warmup,
        warmup_min_ratio=start,
        cos_min_ratio=floor,
        warmup_type=kind,
    )
    sched = build_schedule(SchedulerConfig(type="WarmupCosineLR", params=params), 2e-4)
    for step in range(total + 30):
        want = ref_cosine_lr(
            step, lr=2e-4, total=total, warmup=warmup, kind=kind, start=start, floor=floor
        )
        assert sched.lr_at(step) == pytest.approx(want, rel=1e-12, abs=1e-18), step
    assert sched.lr_at(0) == 0.0
    assert sched.lr_at(total + 100) == pytest.approx(2e-4 * floor)


def test_cosine_mid_point_by_hand():
    params = dict(total_num_steps=12, warmup_num_steps=2, cos_min_ratio=0.0, warmup_type="linear")
    sched = build_schedule(SchedulerConfig(type="WarmupCosineLR", params=params), 1.0)
    # iteration 6 = step 7: progress (6 - 2 + 1) / 10 = 0.5 -> half of the peak
    assert sched.lr_at(7) == pytest.approx(0.5)


def test_constant_when_no_type():
    sched = build_schedule(SchedulerConfig(), 3e-4)
    assert {sched.lr_at(s) for s in (0, 1, 1000)} == {3e-4}


def test_last_batch_iteration_offsets_the_schedule():
    base = {"warmup_num_steps": 10, "warmup_type": "linear"}
    plain = build_schedule(SchedulerConfig(type="WarmupLR", params=base), 1.0)
    shifted = build_schedule(
        SchedulerConfig(type="WarmupLR", params={**base, "last_batch_iteration": 4}), 1.0
    )
    assert [shifted.lr_at(s) for s in range(5)] == [plain.lr_at(s + 5) for s in range(5)]


def test_counter_and_state_dict_round_trip():
    cfg = SchedulerConfig(
        type="WarmupDecayLR", params={"total_num_steps": 50, "warmup_num_steps": 5}
    )
    sched = build_schedule(cfg, 1e-3)
    for _ in range(7):
        sched.step()
    assert sched.lr == sched.lr_at(7)
    state = json.loads(json.dumps(sched.state_dict()))
    fresh = build_schedule(cfg, 1e-3)
    fresh.load_state_dict(state)
    assert fresh.steps == 7 and fresh.lr == sched.lr
    with pytest.raises(ValueError, match="steps"):
        fresh.load_state_dict({"steps": -1})


def test_string_numbers_are_accepted():
    cfg = SchedulerConfig(
        type="WarmupLR", params={"warmup_max_lr": "1e-3", "warmup_num_steps": "1e2"}
    )
    sched = build_schedule(cfg, 0.1)
    assert sched.lr_at(10_000) == pytest.approx(1e-3)
    assert sched.params["warmup_num_steps"] == 100


@pytest.mark.parametrize(
    "kind,params,match",
    [
        ("WarmupLR", {"warmup_max_lrr": 1e-3}, r"warmup_max_lrr.*did you mean 'warmup_max_lr'"),
        ("WarmupLR", {"total_num_steps": 10}, r"total_num_steps: unknown parameter for WarmupLR"),
        ("WarmupDecayLR", {"warmup_num_steps": 100, "total_num_steps": 10}, r"less than warmup"),
        (
            "WarmupCosineLR",
            {"total_num_steps": 10},
            r"less than warmup_num_steps \(1000, the default\)",
        ),
        ("WarmupDecayLR", {"warmup_num_steps": 10}, r"total_num_steps: required"),
        ("WarmupLR", {"warmup_type": "cosine"}, r"warmup_type: 'cosine' is not one of"),
        ("WarmupLR", {"warmup_num_steps": 0}, r"warmup_num_steps: 0 is below the minimum 1"),
        ("WarmupLR", {"warmup_num_steps": 2.5}, r"expected an integer"),
        ("WarmupLR", {"warmup_min_lr": -1.0}, r"negative"),
        ("WarmupCosineLR", {"total_num_steps": 2000, "cos_min_ratio": 2}, r"ratio in \[0, 1\]"),
        ("WarmupLR", {"warmup_max_lr": "auto"}, r"'auto' must be resolved first"),
    ],
)
def test_bad_params(kind, params, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build_schedule(SchedulerConfig(type=kind, params=params), 1e-3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="params given without scheduler.type"):
        build_schedule(SchedulerConfig(params={"warmup_num_steps": 3}), 1e-3)
    with pytest.raises(ValueError, match="step must be >= 0"):
        build_schedule(SchedulerConfig(), 1e-3).lr_at(-1)
    with pytest.raises(ValueError, match="base_lr"):
        build_schedule(SchedulerConfig(type="WarmupLR"), -1.0)
