"""The iteration's lifecycle through the engine: the coordinator's phase after each call,
clear errors for a backward without its forward, modules called outside the engine, and the
same gather decisions on every run whatever the disk's timing (NVMe parameter tier)."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import batches, config, tiny_gpt
from _fake_aio import DelayedAio

import infinity
from infinity.zero import LiveEvent, ParamState, Phase


def _engine(**zero):
    torch.manual_seed(0)
    return infinity.initialize(copy.deepcopy(tiny_gpt(checkpointing=False)), config(**zero))


@pytest.mark.parametrize("plain", [False, True])
def test_phase_follows_forward_and_backward(plain):
    engine = _engine()
    ids = batches(1)[0]
    assert engine.coordinator.phase is Phase.IDLE
    loss = engine(ids, ids)
    assert engine.coordinator.phase is Phase.BACKWARD_PENDING
    with pytest.raises(RuntimeError, match="waiting for its backward"):
        engine.save_checkpoint("unused")
    if plain:
        loss.backward()
    else:
        engine.backward(loss)
    assert engine.coordinator.phase is Phase.IDLE
    engine.step()
    with torch.no_grad():
        engine(ids, ids)
    assert engine.coordinator.phase is Phase.IDLE  # a no-grad forward ends at once
    engine.close()


@pytest.mark.parametrize("plain", [False, True])
def test_a_second_backward_of_one_forward_is_a_clear_error(plain):
    engine = _engine()
    ids = batches(1)[0]
    loss = engine(ids, ids)
    message = (
        r"begin_backward: .*phase IDLE, expected BACKWARD"
        if plain
        else r"backward: no forward is waiting for its backward"
    )
    with pytest.raises(RuntimeError, match=message):
        if plain:
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            engine.backward(loss)
            engine.backward(loss)
    assert engine.coordinator.phase is Phase.IDLE
    # A forward whose backward never came is closed by the next forward: training goes on.
    engine(ids, ids)
    loss = engine(ids, ids)
    engine.backward(loss)
    engine.step()
    engine.close()


def test_forward_after_a_backward_that_raised():
    engine = _engine()
    ids = batches(1)[0]
    loss = engine(ids, ids)

    def boom(grad):
        raise ValueError("boom")

    loss.register_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        loss.backward()
    assert engine.coordinator.phase is Phase.BACKWARD  # left by autograd half-way
    loss = engine(ids, ids)
    loss.backward()
    engine.step()
    assert all(
        r.state is ParamState.RELEASED for r in engine.records if not r.persistent and r.trainable
    )
    engine.close()


def test_module_called_outside_the_engine():
    """No iteration: each call gathers and releases its own parameters, untraced; a backward
    through such a call is refused with the reason."""
    engine = _engine()
    ids = batches(1)[0]
    ref = engine(ids, ids)
    engine.backward(ref)
    with torch.no_grad():
        direct = engine.module(ids, ids)
        through = engine(ids, ids)
    assert torch.equal(direct, through)
    assert engine.coordinator.phase is Phase.IDLE
    assert engine.coordinator.live_numel == 0
    out = engine.module(ids, ids)
    with pytest.raises(RuntimeError, match="backward of module '.*': .*no engine forward waiting"):
        out.backward()
    engine.close()


def _nvme_decisions(tmp_path, seed: int | None):
    """Three training steps with parameters on NVMe (reads delayed at random with `seed`):
    the coordinator's decisions, the losses, and the hit and miss counts."""
    cfg = config(
        stage3_max_live_parameters=6000,
        stage3_prefetch_bucket_size=5000,
        stage3_max_reuse_distance=0,
    )
    z = cfg["zero_optimization"]
    tmp_path.mkdir()
    z["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}
    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(checkpointing=True), cfg)
    if seed is not None:
        store = engine.param_store
        store.aio = DelayedAio(store.aio, seed=seed, max_delay_s=0.002)
    log: list[tuple[str, str]] = []
    engine.coordinator.observers.append(lambda event, rec: log.append((event.value, rec.name)))
    losses = []
    for ids in batches(3, seed=7):
        loss = engine(ids, ids)
        loss.backward()
        engine.step()
        losses.append(loss.item())
    stats = engine.memory_stats()
    engine.close()
    return log, losses, stats


def test_nvme_gathers_are_the_same_whatever_the_read_delays(tmp_path):
    """Across ranks each LIVE transition is an all-gather: with reads finishing after random
    delays, two runs (and one without delays) fetch, gather and release the same parameters
    in the same order, and prefetch still hits."""
    want, losses, stats = _nvme_decisions(tmp_path / "a", None)
    assert {LiveEvent(e) for e, _ in want} == set(LiveEvent)
    for seed in (1, 2):
        got, got_losses, got_stats = _nvme_decisions(tmp_path / f"d{seed}", seed)
        assert got == want, seed
        assert got_losses == losses
        assert got_stats["prefetch_hits"] == stats["prefetch_hits"]
    assert stats["prefetch_hits"] > stats["prefetch_misses"]
    assert stats["budget_overruns"] == 0
