"""The transformers-style schedules (`--lr-schedule constant|linear|cosine`) against
`transformers.get_scheduler`, step for step, on a real optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from infinity.config import Config, RunFacts, SchedulerConfig, resolve_run
from infinity.optim.schedules import build_schedule

transformers = pytest.importorskip("transformers")

LR = 3e-4


def transformers_lrs(
    name: str, steps: int, warmup: int, min_lr: float | None, lr: float = LR
) -> list[float]:
    """The lr transformers' scheduler gives each of `steps` optimizer steps."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    extra = None
    if min_lr is not None and name == "cosine":
        name, extra = "cosine_with_min_lr", {"min_lr": min_lr}
    elif min_lr is not None and name == "linear":
        name = "warmup_stable_decay"
        extra = {
            "num_stable_steps": 0,
            "decay_type": "linear",
            "num_decay_steps": steps - warmup,
            "min_lr_ratio": min_lr / lr,
        }
    elif name == "constant":
        name = "constant_with_warmup"
    sched = transformers.get_scheduler(
        name,
        opt,
        num_warmup_steps=warmup,
        num_training_steps=steps,
        scheduler_specific_kwargs=extra,
    )
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _ours(kind: str, steps: int, params: dict) -> list[float]:
    cfg = resolve_run(
        Config.load(
            {"optimizer": {"params": {"lr": LR}}, "scheduler": {"type": kind, "params": params}}
        ),
        RunFacts(total_num_steps=steps),
    )
    sched = build_schedule(cfg.scheduler, cfg.optimizer.lr)
    return [sched.lr_at(s) for s in range(steps)]


# Constant has no min_lr: its cases are the ones without.
@pytest.mark.parametrize(
    ("kind", "min_lr"),
    [("constant", None), ("linear", None), ("linear", 3e-5), ("cosine", None), ("cosine", 3e-5)],
)
@pytest.mark.parametrize("warmup", [0, 1, 5, 40])
def test_matches_transformers_step_for_step(kind, warmup, min_lr):
    steps = 40
    params = {"total_num_steps": "auto", "warmup_num_steps": warmup}
    if min_lr is not None:
        params["min_lr"] = min_lr
    want = transformers_lrs(kind, steps, warmup, min_lr)
    if kind == "linear" and min_lr is not None:
        # transformers' warmup_stable_decay warms up from min_lr; ours, like every other
        # transformers schedule, from 0: its warmup steps are linear's.
        want[:warmup] = transformers_lrs("linear", steps, warmup, None)[:warmup]
    got = _ours(kind, steps, params)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    if warmup:
        assert got[0] == 0.0  # a warmup starts from 0, as transformers' does
    if kind != "constant" and warmup < steps:
        assert got[-1] < LR / 5  # it decays


def test_warmup_ratio_rounds_up_like_the_trainer():
    steps, ratio = 37, 0.1
    warmup = math.ceil(ratio * steps)  # transformers' TrainingArguments.get_warmup_steps
    assert warmup == 4
    got = _ours("cosine", steps, {"total_num_steps": "auto", "warmup_ratio": ratio})
    assert got == pytest.approx(transformers_lrs("cosine", steps, warmup, None), rel=1e-12)


def test_an_auto_warmup_steps_leaves_the_ratio_in_charge():
    params = {"total_num_steps": "auto", "warmup_num_steps": "auto", "warmup_ratio": 0.25}
    assert _ours("linear", 8, params) == pytest.approx(
        transformers_lrs("linear", 8, 2, None), rel=1e-12
    )
    auto = {"total_num_steps": "auto", "warmup_num_steps": "auto"}
    assert _ours("linear", 8, auto) == pytest.approx(transformers_lrs("linear", 8, 0, None))


def test_past_the_end_the_lr_stays_at_min_lr():
    got = _ours("cosine", 10, {"total_num_steps": 10, "min_lr": 1e-5})
    sched = build_schedule(
        SchedulerConfig(type="cosine", params={"total_num_steps": 10, "min_lr": 1e-5}), LR
    )
    assert got[-1] > 1e-5
    assert [sched.lr_at(s) for s in (10, 11, 50)] == pytest.approx([1e-5] * 3)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"total_num_steps": 10, "warmup_num_steps": 2, "warmup_ratio": 0.1}, "give one"),
        ({"total_num_steps": 10, "warmup_ratio": 1.5}, "ratio in"),
        ({"warmup_num_steps": 2}, "total_num_steps: required"),
        ({"total_num_steps": 10, "min_lr": -1}, "negative"),
    ],
)
def test_bad_parameters_are_named(params, match):
    with pytest.raises(ValueError, match=match):
        Config.load({"scheduler": {"type": "linear", "params": params}})


def test_a_warmup_longer_than_the_run_is_refused_when_built():
    cfg = resolve_run(
        Config.load(
            {
                "scheduler": {
                    "type": "linear",
                    "params": {"total_num_steps": "auto", "warmup_num_steps": 11},
                }
            }
        ),
        RunFacts(total_num_steps=10),
    )
    with pytest.raises(ValueError, match="warmup .11 steps. is longer than the run"):
        build_schedule(cfg.scheduler, LR)


def test_min_lr_above_the_lr_is_refused():
    with pytest.raises(ValueError, match="min_lr .* above the lr"):
        build_schedule(
            SchedulerConfig(type="linear", params={"total_num_steps": 10, "min_lr": 1.0}), LR
        )


def test_constant_takes_no_min_lr():
    with pytest.raises(ValueError, match="unknown parameter"):
        Config.load(
            {"scheduler": {"type": "constant", "params": {"total_num_steps": 3, "min_lr": 0}}}
        )
