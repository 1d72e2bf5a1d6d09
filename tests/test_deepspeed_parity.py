"""Schedules and the dynamic loss scaler against DeepSpeed itself, where it is installed.

DeepSpeed is not a dependency; these tests skip without it. The other tests check the same
rules against formulas written out independently.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from infinity.config import Config, FP16Config, RunFacts, SchedulerConfig, resolve_run
from infinity.optim import build_loss_scaler, build_schedule

lr_schedules = pytest.importorskip(
    "deepspeed.runtime.lr_schedules", reason="DeepSpeed is not installed (optional peer)"
)
ds_loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")

CASES = [
    ("WarmupLR", dict(warmup_min_lr=1e-5, warmup_max_lr=2e-3, warmup_num_steps=10)),
    ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1)),
    ("WarmupLR", dict(warmup_max_lr=1e-3, warmup_num_steps=7, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=40, warmup_max_lr=1e-3, warmup_num_steps=8)),
    (
        "WarmupDecayLR",
        dict(
            total_num_steps=30,
            warmup_min_lr=1e-4,
            warmup_max_lr=5e-3,
            warmup_num_steps=6,
            warmup_type="linear",
        ),
    ),
    ("WarmupCosineLR", dict(total_num_steps=50, warmup_num_steps=10)),
    ("WarmupCosineLR", dict(total_num_steps=3, warmup_num_steps=2)),
    (
        "WarmupCosineLR",
        dict(
            total_num_steps=25,
            warmup_num_steps=4,
            warmup_min_ratio=0.3,
            cos_min_ratio=0.05,
            warmup_type="linear",
        ),
    ),
]


@pytest.mark.parametrize("kind,params", CASES)
def test_lr_sequence_matches_deepspeed(kind, params):
    base_lr = 3e-4
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=base_lr)
    ds = getattr(lr_schedules, kind)(optimizer, **params)  # sets the first step's lr
    ours = build_schedule(SchedulerConfig(type=kind, params=params), base_lr)
    rng = random.Random(7)
    applied = 0
    for _ in range(params.get("total_num_steps", 30) + 20):
        # The lr DeepSpeed's engine steps with is the one in the optimizer now.
        assert ours.lr_at(applied) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12)
        if rng.random() < 0.8:  # a step that was applied; skipped steps do not advance
            ds.step()
            applied += 1


class _Rank0:
    @staticmethod
    def get_rank():
        return 0


@pytest.mark.parametrize("p_overflow", [0.1, 0.3, 0.7])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis,window", [(1, 2), (2, 3), (3, 5)])
def test_dynamic_loss_scale_matches_deepspeed(
    monkeypatch, p_overflow, consecutive, hysteresis, window
):
    monkeypatch.setattr(ds_loss_scaler, "dist", _Rank0)  # it logs the rank on overflow
    ds = ds_loss_scaler.DynamicLossScaler(
        init_scale=2.0**12,
        scale_window=window,
        min_scale=1.0,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
    )
    ours = build_loss_scaler(
        FP16Config(
            enabled=True,
            initial_scale_power=12,
            loss_scale_window=window,
            hysteresis=hysteresis,
            min_loss_scale=1.0,
            consecutive_hysteresis=consecutive,
        )
    )
    rng = random.Random(hysteresis * 10 + window)
    for step in range(500):
        overflow = rng.random() < p_overflow
        ds_error = ours_error = None
        try:
            ds.update_scale(overflow)
        except Exception as e:  # DeepSpeed raises a bare Exception at the minimum scale
            ds_error = e
        try:
            ours.update(overflow)
        except FloatingPointError as e:
            ours_error = e
        assert (ds_error is None) == (ours_error is None), step
        if ds_error is not None:
            return
        assert ours.scale == ds.cur_scale, step


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_raises_at_the_same_step_as_deepspeed(monkeypatch, hysteresis):
    monkeypatch.setattr(ds_loss_scaler, "dist", _Rank0)
    ds = ds_loss_scaler.DynamicLossScaler(
        init_scale=8.0,
        scale_window=4,
        min_scale=1.0,
        delayed_shift=hysteresis,
        consecutive_hysteresis=False,
    )
    ours = build_loss_scaler(
        FP16Config(enabled=True, initial_scale_power=3, loss_scale_window=4, hysteresis=hysteresis)
    )
    ds_step = ours_step = None
    for step in range(20):
        try:
            ds.update_scale(True)
        except Exception:
            ds_step = step if ds_step is None else ds_step
        try:
            ours.update(True)
        except FloatingPointError:
            ours_step = step if ours_step is None else ours_step
        if ds_step is not None or ours_step is not None:
            break
    assert ds_step is not None and ds_step == ours_step


def _zero_sections():
    from test_config import HF_ZERO3, ZERO_INFINITY

    given = json.loads(ZERO_INFINITY)
    resolved = resolve_run(Config.load(HF_ZERO3), RunFacts(hidden_size=256, total_num_steps=100))
    return [
        ("zero-infinity as written", given),
        ("zero-infinity via Infinity", Config.load(given).to_dict()),
        ("hf template resolved", resolved.to_dict()),
        ("defaults", resolve_run(Config(), RunFacts()).to_dict()),
    ]


@pytest.mark.parametrize(
    "name,data", _zero_sections(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_zero_and_aio_sections_read_the_same_in_deepspeed(name, data):
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    aio_config = pytest.importorskip("deepspeed.runtime.swap_tensor.aio_config")
    ds = zero_config.DeepSpeedZeroConfig(**data["zero_optimization"])  # rejects unknown keys
    ours = Config.load(data).zero_optimization
    for field in (
        "stage",
        "max_live_parameters",
        "prefetch_bucket_size",
        "max_reuse_distance",
        "param_persistence_threshold",
        "sub_group_size",
        "gather_16bit_weights_on_model_save",
    ):
        assert getattr(ds, field) == getattr(ours, field), field
    for section in ("offload_param", "offload_optimizer"):
        ds_section, our_section = getattr(ds, section), getattr(ours, section)
        assert getattr(ds_section.device, "value", ds_section.device) == our_section.device
        assert ds_section.buffer_count == our_section.buffer_count
        assert ds_section.pin_memory == our_section.pin_memory
    aio = aio_config.get_aio_config(data)
    if "aio" in data:
        assert aio["intra_op_parallelism"] == Config.load(data).aio.thread_count
        assert aio["queue_depth"] == Config.load(data).aio.queue_depth
