"""The loss scalers against an independent statement of DeepSpeed's dynamic rule."""

from __future__ import annotations

import json
import random

import pytest
import torch

from infinity.config import FP16Config
from infinity.optim.loss_scaler import (
    DynamicLossScaler,
    NoScaler,
    StaticLossScaler,
    build_loss_scaler,
    has_overflow,
)


def reference_scales(events, *, scale, window, hysteresis, min_scale, consecutive):
    """Scale after each event, stated with a run length of good steps instead of iterations."""
    good_run, tolerance, out = 0, hysteresis, []
    for overflow in events:
        if overflow:
            good_run = 0
            if tolerance > 1:
                tolerance -= 1
            else:
                scale = max(scale / 2, min_scale)
        else:
            good_run += 1
            if consecutive:
                tolerance = hysteresis
            if good_run > 1 and (good_run - 1) % window == 0:
                scale *= 2
                tolerance = hysteresis
        out.append(scale)
    return out


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis,window", [(1, 1), (2, 3), (4, 5), (2, 1000)])
@pytest.mark.parametrize("p_overflow", [0.05, 0.3, 0.7])
def test_dynamic_matches_reference(consecutive, hysteresis, window, p_overflow):
    rng = random.Random(hash((consecutive, hysteresis, window, p_overflow)) & 0xFFFF)
    events = [rng.random() < p_overflow for _ in range(400)]
    scaler = DynamicLossScaler(
        init_scale=2.0**10,
        scale_window=window,
        min_scale=1.0,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_at_min_scale=False,
    )
    got = []
    for overflow in events:
        scaler.update(overflow)
        got.append(scaler.scale)
    want = reference_scales(
        events,
        scale=2.0**10,
        window=window,
        hysteresis=hysteresis,
        min_scale=1.0,
        consecutive=consecutive,
    )
    assert got == want


def test_dynamic_by_hand():
    s = build_loss_scaler(
        FP16Config(enabled=True, initial_scale_power=8, loss_scale_window=3, hysteresis=2)
    )
    assert s.dynamic and s.scale == 256.0
    s.update(True)  # tolerated by the hysteresis
    assert s.scale == 256.0
    s.update(True)  # halved
    assert s.scale == 128.0
    s.update(True)  # hysteresis is not refilled by halving: halved again
    assert s.scale == 64.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 64.0  # the first doubling needs window + 1 good steps
    s.update(False)
    assert s.scale == 128.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 256.0  # then one every window
    s.update(True)  # refilled at the doubling: tolerated again
    assert s.scale == 256.0


def test_consecutive_hysteresis_refills_on_each_good_step():
    kw = dict(initial_scale_power=4, loss_scale_window=100, hysteresis=2)
    plain = build_loss_scaler(FP16Config(enabled=True, **kw))
    consec = build_loss_scaler(FP16Config(enabled=True, consecutive_hysteresis=True, **kw))
    for overflow in (True, False, True):
        plain.update(overflow)
        consec.update(overflow)
    assert plain.scale == 8.0
    assert consec.scale == 16.0


def test_raises_at_minimum_scale():
    s = build_loss_scaler(
        FP16Config(enabled=True, initial_scale_power=1, hysteresis=1, min_loss_scale=1.0)
    )
    s.update(True)
    assert s.scale == 1.0
    with pytest.raises(FloatingPointError, match="minimum loss scale 1"):
        s.update(True)


def test_never_below_min_scale():
    s = build_loss_scaler(
        FP16Config(enabled=True, initial_scale_power=2, hysteresis=1, min_loss_scale=3.0)
    )
    s.update(True)
    assert s.scale == 3.0


def test_static_and_none():
    static = build_loss_scaler(FP16Config(enabled=True, loss_scale=128.0))
    assert isinstance(static, StaticLossScaler) and not static.dynamic
    for overflow in (True, True, False):
        static.update(overflow)
    assert static.scale == 128.0
    none = build_loss_scaler(FP16Config(enabled=False))
    assert isinstance(none, NoScaler) and none.scale == 1.0
    none.update(True)
    assert none.scale == 1.0


def test_build_rejects_auto_and_negative():
    with pytest.raises(ValueError, match="resolve"):
        build_loss_scaler(FP16Config(enabled="auto"))
    with pytest.raises(ValueError, match="negative"):
        build_loss_scaler(FP16Config(enabled=True, loss_scale=-1.0))


def test_state_dict_round_trip_continues_identically():
    cfg = FP16Config(enabled=True, initial_scale_power=6, loss_scale_window=2, hysteresis=2)
    a = build_loss_scaler(cfg)
    events = [True, False, True, True, False, False, False]
    for e in events:
        a.update(e)
    b = build_loss_scaler(cfg)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for e in [False, False, True, True, False, False, False]:
        a.update(e)
        b.update(e)
        assert a.scale == b.scale
    with pytest.raises(ValueError, match="from a StaticLossScaler"):
        b.load_state_dict(StaticLossScaler(4.0).state_dict())
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({"kind": "DynamicLossScaler", "scale": 1.0})


def test_bad_dynamic_arguments():
    with pytest.raises(ValueError, match="must be > 0"):
        DynamicLossScaler(init_scale=0.0, scale_window=1, min_scale=1.0, hysteresis=1)
    with pytest.raises(ValueError, match=">= 1"):
        DynamicLossScaler(init_scale=1.0, scale_window=0, min_scale=1.0, hysteresis=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_has_overflow_finds_one_bad_element(dtype, bad):
    tensors = [torch.randn(n).to(dtype) for n in (0, 1, 7, 1000, 4097)]
    assert not has_overflow(tensors)
    tensors[3][123] = bad
    assert has_overflow(tensors)
    assert has_overflow([tensors[3]])


def test_has_overflow_edge_cases():
    assert not has_overflow([])
    assert not has_overflow([torch.empty(0), torch.arange(5)])  # integers are always finite
    big = torch.full((1000,), 3e38)  # finite, though their sum would overflow
    assert not has_overflow([big])
    assert has_overflow([big, torch.tensor([float("nan")])])  # the real one is still found
    assert has_overflow([torch.tensor([float("inf"), float("-inf")])])  # sum is NaN
    assert not has_overflow([torch.full((4096,), 60000.0, dtype=torch.float16)])  # fp32 sum
    assert not has_overflow([torch.full((10,), 3e38, dtype=torch.bfloat16)])
    mixed = [torch.ones(3, dtype=torch.float16), torch.tensor([1.0, float("nan")])]
    assert has_overflow(mixed)
    assert not has_overflow(t for t in [torch.ones(2), torch.zeros(2, 2)])
