"""steps_per_print and wall_clock_breakdown: the engine's progress and timing lines."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from _engine_models import batches, config, tiny_gpt

import infinity
from infinity.accelerator.cpu import CpuAccelerator
from infinity.utils.step_timer import StepTimer

PROGRESS = re.compile(
    r"^step (\d+): lr [0-9.e+-]+, loss scale [0-9.e+]+, grad norm [0-9.e+-]+, skipped steps 0$"
)
BREAKDOWN = re.compile(r"^step (\d+) time: forward [0-9.]+ ms \| backward [0-9.]+ ms \| step ")


class CountingAccelerator(CpuAccelerator):
    def __init__(self):
        super().__init__()
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def _train(caplog, steps: int, accum: int = 1, accelerator=None, **top):
    cfg = config()
    cfg.update(top, gradient_accumulation_steps=accum)
    torch.manual_seed(0)
    engine = infinity.initialize(
        copy.deepcopy(tiny_gpt(checkpointing=False)), cfg, accelerator=accelerator
    )
    with caplog.at_level(logging.INFO, logger="infinity.engine"):
        for ids in batches(steps * accum, seed=1):
            engine.backward(engine(ids, ids))
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "infinity.engine"]
    return engine, lines


@pytest.mark.parametrize("every,want", [(2, [2, 4, 6]), (3, [3, 6]), (10, [])])
def test_steps_per_print_sets_how_often_progress_is_logged(caplog, every, want):
    engine, lines = _train(caplog, steps=6, accum=2, steps_per_print=every)
    progress = [PROGRESS.match(line) for line in lines]
    assert [int(m.group(1)) for m in progress if m] == want
    assert not [line for line in lines if BREAKDOWN.match(line)]  # no timing unless asked
    assert engine.wall_clock_breakdown() == {}
    engine.close()


def test_progress_line_carries_the_steps_numbers(caplog):
    engine, lines = _train(caplog, steps=2, steps_per_print=2)
    (line,) = [line for line in lines if PROGRESS.match(line)]
    assert f"lr {engine.get_lr()[0]:.4g}" in line  # a constant schedule: the lr it used
    assert f"grad norm {engine.get_global_grad_norm():.4g}" in line
    engine.close()


def test_wall_clock_breakdown_times_each_phase_of_every_step(caplog):
    accel = CountingAccelerator()
    engine, lines = _train(
        caplog, steps=4, accum=2, accelerator=accel, steps_per_print=2, wall_clock_breakdown=True
    )
    timed = [int(m.group(1)) for m in map(BREAKDOWN.match, lines) if m]
    assert timed == [2, 4]
    last = engine.wall_clock_breakdown()
    assert list(last)[:3] == ["forward", "backward", "step"]
    assert {"step.norm", "step.adam", "step.zero_grad"} <= set(last)
    assert all(v > 0.0 for k, v in last.items() if k in ("forward", "backward", "step"))
    assert last["step.adam"] <= last["step"]
    # Two micro steps (forward and backward each) and one optimizer step, both ends of each.
    assert accel.synchronized >= 4 * (2 + 2 + 1) * 2
    engine.close()


def test_wall_clock_breakdown_counts_the_waits_for_the_disk(caplog, tmp_path):
    engine, lines = _train(
        caplog,
        steps=3,
        steps_per_print=1,
        wall_clock_breakdown=True,
        zero_optimization={
            **config(sub_group_size=3000)["zero_optimization"],
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
    )
    last = engine.wall_clock_breakdown()
    assert 0.0 <= last["step.nvme_wait"] <= last["step"]
    assert last["nvme_param_wait"] >= 0.0
    # A per-step figure, not the running total the memory stats keep.
    total_s = engine.memory_stats()["nvme_optim_wait_us"] / 1e6
    assert last["step.nvme_wait"] <= total_s + 1e-6
    assert "step.nvme_wait" in [line for line in lines if BREAKDOWN.match(line)][-1]
    engine.close()


def test_timer_is_free_when_disabled():
    calls = []
    timer = StepTimer(enabled=False, synchronize=lambda: calls.append(1))
    timer.stop("forward", timer.start())
    timer.add("step", 1.0)
    assert timer.finish() == {} and calls == []


def test_timer_sums_a_step_and_starts_the_next_at_zero():
    timer = StepTimer(enabled=True, synchronize=lambda: None)
    timer.add("forward", 0.25)
    timer.add("forward", 0.5)
    timer.add("step", 1.0)
    assert timer.finish() == {"forward": 0.75, "step": 1.0}
    timer.add("forward", 0.125)
    assert timer.finish() == {"forward": 0.125}
    assert timer.last == {"forward": 0.125}


def test_timer_turns_running_totals_into_per_step_figures():
    timer = StepTimer(enabled=True, synchronize=lambda: None)
    timer.add_total("wait", 2.0)
    assert timer.finish() == {"wait": 2.0}
    timer.add_total("wait", 2.5)
    assert timer.finish() == {"wait": 0.5}
    timer.add_total("wait", 3.0)
    timer.discard()  # a baseline: waits before it are nobody's step
    timer.add_total("wait", 3.25)
    assert timer.finish() == {"wait": 0.25}
