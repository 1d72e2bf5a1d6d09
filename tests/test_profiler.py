"""engine.profile / StepProfiler: a Chrome trace of chosen optimizer steps with the engine's
named ranges, written atomically."""

from __future__ import annotations

import copy
import errno
import json
import os
from pathlib import Path

import pytest
import torch
from _engine_models import batches, config, tiny_gpt

import infinity
from infinity.utils.profiler import StepProfiler


def _engine(tmp_path, nvme: bool):
    cfg = config(sub_group_size=3000)
    if nvme:
        swap = tmp_path / "swap"
        swap.mkdir()
        cfg["zero_optimization"].update(
            offload_optimizer={"device": "nvme", "nvme_path": str(swap)},
            offload_param={"device": "nvme", "nvme_path": str(swap)},
        )
    torch.manual_seed(0)
    return infinity.initialize(copy.deepcopy(tiny_gpt(checkpointing=False)), cfg)


def _steps(engine, n: int) -> None:
    for ids in batches(n, seed=1):
        engine.backward(engine(ids, ids))
        engine.step()


def _range_names(path) -> set[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("infinity::")}


@pytest.mark.parametrize("nvme", [False, True], ids=["cpu", "nvme"])
def test_trace_holds_the_engines_ranges(tmp_path, nvme):
    engine = _engine(tmp_path, nvme)
    prof = engine.profile(2, tmp_path / "profile")
    _steps(engine, 2)
    assert prof.path is None  # the warm-up step and one of two recorded
    _steps(engine, 2)
    assert prof.recorded == (2, 3)
    assert prof.path == tmp_path / "profile" / "trace-steps-2-3.json"
    names = _range_names(prof.path)
    want = {
        "infinity::engine::forward",
        "infinity::engine::backward",
        "infinity::engine::step",
        "infinity::zero::gather",
        "infinity::zero::release",
        "infinity::zero::accumulate_grad",
        "infinity::zero::adam_sub_group",
    }
    if nvme:
        want |= {"infinity::swap::param_wait", "infinity::swap::optim_wait"}
    assert want <= names
    assert [p.name for p in (tmp_path / "profile").iterdir()] == [prof.path.name]  # no temp
    engine.profile(1, tmp_path / "again", warmup_steps=0)  # the first one is finished
    engine.close()


def test_closing_early_writes_the_steps_recorded(tmp_path):
    engine = _engine(tmp_path, nvme=False)
    prof = engine.profile(5, tmp_path / "profile")
    _steps(engine, 3)
    engine.close()
    assert prof.recorded == (2, 3)
    assert "infinity::zero::gather" in _range_names(prof.path)


def test_stop_in_the_warm_up_writes_nothing(tmp_path):
    engine = _engine(tmp_path, nvme=False)
    prof = engine.profile(1, tmp_path / "profile", warmup_steps=2)
    _steps(engine, 1)
    assert prof.stop() is None and prof.path is None
    assert not list((tmp_path / "profile").iterdir())
    engine.close()


def test_one_profile_at_a_time(tmp_path):
    engine = _engine(tmp_path, nvme=False)
    engine.profile(1, tmp_path / "profile")
    with pytest.raises(RuntimeError, match="already being recorded"):
        engine.profile(1, tmp_path / "profile")
    engine.close()


@pytest.mark.parametrize(
    "steps,warmup,bad", [(0, 1, "steps"), (2, -1, "warmup_steps"), (1.5, 1, "steps")]
)
def test_bad_step_counts_are_refused(tmp_path, steps, warmup, bad):
    with pytest.raises(ValueError, match=f"profile: {bad} must be an integer"):
        StepProfiler(steps, tmp_path, warmup_steps=warmup)


def test_a_trace_that_cannot_be_written_does_not_stop_training(tmp_path, monkeypatch):
    def full_disk(self, path):
        Path(path).write_text("{")  # a partial file, as a full disk leaves it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", full_disk)
    engine = _engine(tmp_path, nvme=False)
    prof = engine.profile(1, tmp_path / "profile")
    _steps(engine, 3)  # the trace fails after step 2; steps go on
    assert engine.global_steps == 3 and prof.path is None
    assert "could not write" in prof.error and "No space left on device" in prof.error
    assert not list((tmp_path / "profile").iterdir())  # the partial file is gone
    engine.close()
