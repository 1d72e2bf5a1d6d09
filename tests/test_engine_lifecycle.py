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
    assert engine.parts.coordinator.phase is Phase.IDLE
    loss = engine(ids, ids)
    assert engine.parts.coordinator.phase is Phase.BACKWARD_PENDING
    with pytest.raises(RuntimeError, match="waiting for its backward"):
        engine.save_checkpoint("unused")
    if plain:
        loss.backward()
    else:
        engine.backward(loss)
    assert engine.parts.coordinator.phase is Phase.IDLE
    engine.step()
    with torch.no_grad():
        engine(ids, ids)
    assert engine.parts.coordinator.phase is Phase.IDLE  # a no-grad forward ends at once
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
    assert engine.parts.coordinator.phase is Phase.IDLE
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
    assert engine.parts.coordinator.phase is Phase.BACKWARD  # left by autograd half-way
    loss = engine(ids, ids)
    loss.backward()
    engine.step()
    assert all(
        r.state is ParamState.RELEASED
        for r in engine.parts.records
        if not r.persistent and r.trainable
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
    assert engine.parts.coordinator.phase is Phase.IDLE
    assert engine.parts.coordinator.live_numel == 0
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
        store = engine.parts.param_tier
        store.aio = DelayedAio(store.aio, seed=seed, max_delay_s=0.002)
    log: list[tuple[str, str]] = []
    engine.parts.coordinator.observers.append(
        lambda event, rec: log.append((event.value, rec.name))
    )
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


def _clean_state(engine) -> None:
    """After an aborted iteration: no phase, no running call, no pin, nothing waited for."""
    assert engine.parts.coordinator.phase is Phase.IDLE
    assert not engine.parts.hooks.stack and not engine.parts.hooks._waiting
    assert not engine.parts.hooks.busy
    assert all(r.pins == 0 for r in engine.parts.records)
    assert not engine.parts.entry._started


def _raise_once_in(module, where: str):
    """Make `module` raise once: in its forward, or when its output's gradient arrives."""

    def boom(*_):
        raise ValueError("boom")

    def pre(mod, args):
        handle.remove()
        boom()

    def post(mod, args, out):
        handle.remove()
        out.register_hook(boom)

    handle = (
        module.register_forward_pre_hook(pre)
        if where == "forward"
        else module.register_forward_hook(post)
    )


def _train(engine, ids_list, fail_at=None, where="forward", plain=False):
    """Losses and final weights of a step per batch; with `fail_at`, an iteration that raises
    inside the model (`where`) first, whose partial gradients are dropped."""
    losses = []
    for step, ids in enumerate(ids_list):
        if step == fail_at:
            rng = torch.get_rng_state()
            _raise_once_in(engine.module.model.layers[1], where)
            with pytest.raises(ValueError, match="boom"):
                loss = engine(ids, ids)
                loss.backward() if plain else engine.backward(loss)
            if not plain or where == "forward":
                _clean_state(engine)
            engine.parts.optimizer.zero_grad()  # what the failed backward accumulated
            torch.set_rng_state(rng)
        loss = engine(ids, ids)
        loss.backward() if plain else engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    _clean_state(engine)
    weights = {n: w.clone() for n, w in engine.named_parameters_host()}
    engine.close()
    return losses, weights


@pytest.mark.parametrize(
    "where,plain", [("forward", False), ("backward", False), ("backward", True)]
)
def test_an_exception_inside_the_model_leaves_the_next_step_bitwise_clean(where, plain):
    """A forward or backward that raises aborts its iteration through the coordinator's
    context managers: the hooks and the entry, subscribed to its end, are reset, and the
    steps after it give bitwise the losses and weights of a run that never failed."""
    ids_list = batches(3, seed=3)
    ref_losses, ref_weights = _train(_engine(), ids_list)
    losses, weights = _train(_engine(), ids_list, fail_at=1, where=where, plain=plain)
    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        assert torch.equal(w, ref_weights[name]), name


def test_forward_context_aborts_on_exception_and_notifies_subscribers():
    """The coordinator's `forward` context: an exception inside aborts (IDLE, everything
    released, every `on_end` subscriber called once); a clean exit without gradients ends
    the iteration the same way."""
    engine = _engine()
    coord = engine.parts.coordinator
    ends = []
    coord.on_end.append(lambda: ends.append(coord.phase))
    with pytest.raises(KeyError), coord.forward("k", backward=True):
        assert coord.phase is Phase.FORWARD
        raise KeyError("inside")
    assert ends == [Phase.IDLE] and coord.phase is Phase.IDLE and coord.live_numel == 0
    with coord.forward("k", backward=False):
        pass
    assert len(ends) == 2 and coord.phase is Phase.IDLE
    with coord.forward("k", backward=True):
        pass
    assert coord.phase is Phase.BACKWARD_PENDING and len(ends) == 2
    with pytest.raises(KeyError), coord.backward():
        raise KeyError("inside")
    assert coord.phase is Phase.IDLE and len(ends) == 3
    engine.close()
