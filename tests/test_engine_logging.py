"""steps_per_print and wall_clock_breakdown: the engine's progress and timing lines, and the
per-step telemetry behind them."""

from __future__ import annotations

import copy
import dataclasses
import logging
import re

import pytest
import torch
from _engine_models import batches, config, tiny_gpt

import infinity
from infinity.accelerator.cpu import CpuAccelerator
from infinity.utils.step_timer import StepTimer
from infinity.utils.telemetry import CounterDeltas, nvme_bytes

PROGRESS = re.compile(
    r"^step (\d+): lr [0-9.e+-]+, loss scale [0-9.e+]+, grad norm [0-9.e+-]+, skipped steps 0$"
)
BREAKDOWN = re.compile(
    r"^step (\d+) time: [0-9.]+ ms \| forward [0-9.]+ ms \| backward [0-9.]+ ms \| optimizer "
)


class CountingAccelerator(CpuAccelerator):
    def __init__(self, *, alias_host: bool = True):
        super().__init__(alias_host=alias_host)
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def _train(caplog, steps: int, accum: int = 1, accelerator=None, plain=False, each=None, **top):
    """Train `steps` optimizer steps; `plain` backward through `loss.backward()`; `each` is
    called after every optimizer step with the engine."""
    cfg = config()
    cfg.update(top, gradient_accumulation_steps=accum)
    torch.manual_seed(0)
    engine = infinity.initialize(
        copy.deepcopy(tiny_gpt(checkpointing=False)), cfg, accelerator=accelerator
    )
    with caplog.at_level(logging.INFO, logger="infinity.engine"):
        for i, ids in enumerate(batches(steps * accum, seed=1)):
            loss = engine(ids, ids)
            loss.backward() if plain else engine.backward(loss)
            engine.step()
            if each is not None and (i + 1) % accum == 0:
                each(engine)
    lines = [r.getMessage() for r in caplog.records if r.name == "infinity.engine"]
    return engine, lines


def _nvme(tmp_path) -> dict:
    return {
        **config(sub_group_size=3000)["zero_optimization"],
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
    }


@pytest.mark.parametrize("every,want", [(2, [2, 4, 6]), (3, [3, 6]), (10, [])])
def test_steps_per_print_sets_how_often_progress_is_logged(caplog, every, want):
    engine, lines = _train(caplog, steps=6, accum=2, steps_per_print=every)
    progress = [PROGRESS.match(line) for line in lines]
    assert [int(m.group(1)) for m in progress if m] == want
    assert not [line for line in lines if BREAKDOWN.match(line)]  # no timing line unless asked
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
    assert list(last)[:4] == [
        "step_seconds",
        "forward_seconds",
        "backward_seconds",
        "optimizer_seconds",
    ]
    assert all(last[k] > 0.0 for k in ("forward_seconds", "backward_seconds"))
    assert 0.0 < last["optimizer_compute_seconds"] <= last["optimizer_seconds"]
    assert engine.last_step_telemetry().synchronized
    # Two micro steps (forward and backward each) and one optimizer step, both ends of each.
    assert accel.synchronized >= 4 * (2 + 2 + 1) * 2
    engine.close()


@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copied"])
@pytest.mark.parametrize("plain", [False, True], ids=["engine_backward", "loss_backward"])
def test_telemetry_of_every_step_without_synchronizing(caplog, plain, alias):
    accel = CountingAccelerator(alias_host=alias)
    records = []
    engine, lines = _train(
        caplog,
        steps=3,
        accum=2,
        accelerator=accel,
        plain=plain,
        each=lambda e: records.append(e.last_step_telemetry()),
    )
    assert accel.synchronized == 0  # no wall_clock_breakdown: no device synchronization
    assert not engine.wall_clock_breakdown()
    assert not [line for line in lines if BREAKDOWN.match(line)]
    assert [t.step for t in records] == [1, 2, 3]
    for t in records:
        parts = t.forward_seconds + t.backward_seconds + t.optimizer_seconds
        assert t.forward_seconds > 0 and t.backward_seconds > 0 and t.optimizer_seconds > 0
        assert parts <= t.step_seconds + 1e-6
        assert t.gather_wait_seconds <= t.forward_seconds + t.backward_seconds
        assert t.optimizer_compute_seconds <= t.optimizer_seconds
        # The cpu tier moves nothing to or from NVMe; gathers copy the weights to the device,
        # unless they alias their homes (the CPU device's default).
        assert (t.nvme_read_bytes, t.nvme_write_bytes, t.nvme_wait_seconds) == (0, 0, 0.0)
        if alias:
            assert t.host_to_device_bytes == 0 and t.copy_seconds == 0
        else:
            assert t.host_to_device_bytes > 0 and t.copy_seconds > 0
        assert t.peak_rss_bytes > 1 << 20 and not t.synchronized
    engine.close()


def test_plain_backward_is_timed_as_backward(caplog):
    """Without the entry's timing a plain `loss.backward()` counted nowhere."""
    steps = []
    _train(caplog, steps=2, plain=True, each=lambda e: steps.append(e.last_step_telemetry()))
    assert all(t.backward_seconds > 0 for t in steps)


def test_telemetry_counts_each_steps_nvme_bytes(caplog, tmp_path):
    seen = []

    def each(engine):
        stats = engine.memory_stats()
        seen.append((engine.last_step_telemetry(), nvme_bytes(stats), stats))

    engine, _ = _train(caplog, steps=3, each=each, zero_optimization=_nvme(tmp_path))
    for (t, (read, written), stats), prev in zip(seen[1:], seen, strict=False):
        assert (t.nvme_read_bytes, t.nvme_write_bytes) == (read - prev[1][0], written - prev[1][1])
        assert t.nvme_read_bytes > 0 and t.nvme_write_bytes > 0
        waited_us = stats["nvme_optim_wait_us"] - prev[2]["nvme_optim_wait_us"]
        assert t.nvme_optim_wait_seconds == pytest.approx(waited_us / 1e6)
        assert t.nvme_optim_wait_seconds <= t.optimizer_seconds
        assert t.nvme_wait_seconds <= t.step_seconds
    engine.close()


def test_checkpoint_io_is_no_steps(caplog, tmp_path):
    (tmp_path / "swap").mkdir()
    engine, _ = _train(caplog, steps=1, zero_optimization=_nvme(tmp_path / "swap"))
    before_save = nvme_bytes(engine.memory_stats())
    engine.save_checkpoint(tmp_path / "ckpt")  # reads every state from NVMe
    after_save = nvme_bytes(engine.memory_stats())
    assert after_save[0] > before_save[0]
    ids = next(iter(batches(1, seed=2)))
    engine.backward(engine(ids, ids))
    engine.step()
    t = engine.last_step_telemetry()
    read, written = nvme_bytes(engine.memory_stats())
    assert (t.nvme_read_bytes, t.nvme_write_bytes) == (
        read - after_save[0],
        written - after_save[1],
    )
    engine.close()


def test_wall_clock_breakdown_logs_the_waits_for_the_disk(caplog, tmp_path):
    engine, lines = _train(
        caplog,
        steps=3,
        steps_per_print=1,
        wall_clock_breakdown=True,
        zero_optimization=_nvme(tmp_path),
    )
    last = engine.wall_clock_breakdown()
    assert 0.0 <= last["nvme_optim_wait_seconds"] <= last["optimizer_seconds"]
    assert last["nvme_param_wait_seconds"] >= 0.0
    # A per-step figure, not the running total the memory stats keep.
    total_s = engine.memory_stats()["nvme_optim_wait_us"] / 1e6
    assert last["nvme_optim_wait_seconds"] <= total_s + 1e-6
    line = [line for line in lines if BREAKDOWN.match(line)][-1]
    assert "nvme wait: params" in line and " read, " in line
    engine.close()


def test_compact_line_names_the_parts():
    t = _telemetry(forward_seconds=0.214, backward_seconds=0.4, optimizer_seconds=12.34)
    t = dataclasses.replace(t, nvme_param_wait_seconds=0.05, nvme_optim_wait_seconds=0.05)
    assert t.compact() == "fw 0.21 bw 0.40 opt 12.3 io 0.10"


def _telemetry(**seconds):
    from infinity.utils.telemetry import step_telemetry

    return step_telemetry(
        step=1,
        window_s=20.0,
        phases={k.removesuffix("_seconds"): v for k, v in seconds.items()},
        deltas={},
        optimizer_compute_s=0.0,
        peak_device_bytes=0,
        synchronized=False,
    )


def test_timer_synchronizes_only_when_asked():
    calls = []
    timer = StepTimer()
    timer.stop("forward", timer.start())
    assert calls == [] and not timer.synchronizes
    timer = StepTimer(synchronize=lambda: calls.append(1))
    timer.stop("forward", timer.start())
    assert calls == [1, 1]


def test_timer_sums_a_step_and_starts_the_next_at_zero():
    timer = StepTimer()
    timer.add("forward", 0.25)
    timer.add("forward", 0.5)
    timer.add("step", 1.0)
    assert timer.finish() == {"forward": 0.75, "step": 1.0}
    timer.add("forward", 0.125)
    assert timer.finish() == {"forward": 0.125}
    assert timer.last == {"forward": 0.125}


def test_timer_window_opens_at_the_first_phase():
    timer = StepTimer()
    start = timer.start()
    timer.stop("forward", start)
    timer.stop("backward", timer.start())
    timer.finish()
    assert timer.last_window_s >= sum(timer.last.values())
    timer.finish()  # nothing timed: an empty window
    assert timer.last_window_s < 0.01


def test_counter_deltas_turn_running_totals_into_per_step_figures():
    deltas = CounterDeltas({"wait": 1.0, "bytes": 10})
    assert deltas.take({"wait": 3.0, "bytes": 10}) == {"wait": 2.0, "bytes": 0}
    deltas.rebase({"wait": 5.0, "bytes": 50})  # what grew in between is no step's
    assert deltas.take({"wait": 5.25, "bytes": 60, "new": 4}) == {
        "wait": 0.25,
        "bytes": 10,
        "new": 4,
    }


def test_evaluation_forwards_belong_to_no_step(caplog):
    seen = []

    def each(engine):
        seen.append(engine.last_step_telemetry())
        if engine.global_steps == 1:  # an evaluation between steps 1 and 2
            with torch.no_grad():
                for ids in batches(3, seed=9):
                    engine(ids, ids)

    engine, _ = _train(caplog, steps=3, each=each)
    # Step 2 copies and gathers what step 3 does: the evaluation's copies are in neither.
    assert seen[1].host_to_device_bytes == seen[2].host_to_device_bytes
    assert seen[1].prefetch_hits + seen[1].prefetch_misses == (
        seen[2].prefetch_hits + seen[2].prefetch_misses
    )
    engine.close()


def test_counter_deltas_skip_what_grew_between_steps():
    deltas = CounterDeltas({"bytes": 0})
    deltas.skip({"bytes": 10}, {"bytes": 25})
    assert deltas.take({"bytes": 40}) == {"bytes": 25}
