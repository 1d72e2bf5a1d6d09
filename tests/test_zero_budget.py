"""The live budget is a hard bound, prefetch follows the traced order, and the trace updates."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import (
    Zoo,
    batches,
    config,
    max_rel_diff,
    run_engine,
    run_reference,
    tiny_gpt,
    train_steps,
)
from torch.multiprocessing.reductions import StorageWeakRef

import infinity
from infinity.accelerator import CpuAccelerator
from infinity.zero import Coordinator


class _Checked(Coordinator):
    """Checks the live count after every fetch (the point where it can grow)."""

    bound = 0
    worst = 0

    def _fetch(self, rec, **kwargs):
        fetched = super()._fetch(rec, **kwargs)
        type(self).worst = max(type(self).worst, self.live_numel)
        assert self.live_numel <= type(self).bound, (self.live_numel, type(self).bound)
        return fetched


def _largest_unit(engine) -> int:
    return max(u.numel for u in engine.parts.hooks.units.values())


@pytest.mark.parametrize("fraction", [0.15, 0.3, 0.6])
def test_budget_bound_and_prefetch_hits(monkeypatch, fraction):
    torch.manual_seed(0)
    model = tiny_gpt(layers=4, hidden=32, checkpointing=True)
    total = sum(p.numel() for p in model.parameters())
    budget = int(total * fraction)
    # The largest unit of this model is the tied embedding (vocab x hidden).
    largest = max(p.numel() for p in model.parameters())
    _Checked.bound, _Checked.worst = budget + largest, 0
    monkeypatch.setattr("infinity.assemble.Coordinator", _Checked)
    cfg = config(
        stage3_max_live_parameters=budget,
        stage3_prefetch_bucket_size=budget // 2,
        stage3_max_reuse_distance=budget // 4,
    )
    data = batches(4, seed=4)
    ref, _ = run_reference(model, data)
    got, engine = run_engine(model, data[:1], cfg)
    assert _largest_unit(engine) == largest
    first = engine.memory_stats()
    more = train_steps(engine, data[1:])
    stats = engine.memory_stats()
    assert max_rel_diff([*got, *more], ref) < 1e-5
    assert stats["peak_live_param_numel"] <= budget + largest
    assert _Checked.worst == stats["peak_live_param_numel"] and _Checked.worst > 0
    assert stats["budget_overruns"] == 0
    hits = stats["prefetch_hits"] - first["prefetch_hits"]
    misses = stats["prefetch_misses"] - first["prefetch_misses"]
    assert hits + misses > 0
    assert hits / (hits + misses) >= 0.95, (hits, misses)


def test_order_change_updates_trace_and_stays_correct():
    torch.manual_seed(0)
    model = Zoo()
    data = batches(8, seed=5)
    marks = {}

    def before(step, module):
        if step == 3:  # a different branch from now on: the middle block is bypassed
            module.skip = {1}
            if hasattr(module, "blocks") and module is not model:
                marks["before"] = dict(engine_stats())

    engines = []

    def engine_stats():
        return engines[0].memory_stats() if engines else {}

    ref, _ = run_reference(model, data, before=before)
    cfg = config(stage3_max_live_parameters=3000)

    engine = infinity.initialize(copy.deepcopy(model), cfg)
    engines.append(engine)
    got = []
    for step, ids in enumerate(data):
        before(step, engine.module)
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    assert max_rel_diff(got, ref) < 1e-5
    after = engine.memory_stats()
    # Updated once at the change, then followed.
    assert after["trace_updates"] - marks["before"]["trace_updates"] == 1
    hits = after["prefetch_hits"] - marks["before"]["prefetch_hits"]
    misses = after["prefetch_misses"] - marks["before"]["prefetch_misses"]
    # Misses only in the iteration that took the new branch.
    assert hits / (hits + misses) > 0.9, (hits, misses)
    # Eval/no-grad inference keeps its own trace and leaves nothing gathered.
    engine.eval()
    with torch.no_grad():
        logits = engine(data[0])
    assert logits.shape == (2, 8, 64)
    assert engine.memory_stats()["live_param_numel"] == 0


def test_persistent_parameters_stay_gathered():
    torch.manual_seed(0)
    model = Zoo()
    small = [n for n, p in model.named_parameters() if p.numel() < 40]
    assert small  # biases and norm weights
    data = batches(3, seed=6)
    ref, _ = run_reference(model, data)
    got, engine = run_engine(model, data, config(stage3_param_persistence_threshold=40))
    assert max_rel_diff(got, ref) < 1e-5
    live = {r.name for r in engine.parts.records if r.state.name == "LIVE"}
    assert live == set(small)
    assert engine.memory_stats()["live_param_numel"] == sum(
        p.numel() for p in model.parameters() if p.numel() < 40
    )


@pytest.mark.parametrize("checkpointing", [False, True])
def test_released_buffers_are_really_freed(checkpointing):
    """Ops save views of weights (F.linear saves weight.t()); those must not keep a released
    buffer alive until backward, or the budget would only be on paper."""
    torch.manual_seed(0)
    model = tiny_gpt(layers=2, hidden=32, checkpointing=checkpointing)
    cfg = config(
        stage3_max_live_parameters=3000,
        stage3_max_reuse_distance=0,
        stage3_prefetch_bucket_size=1,
    )
    engine = infinity.initialize(
        copy.deepcopy(model), cfg, accelerator=CpuAccelerator(alias_host=False)
    )
    released = []
    release = engine.parts.coordinator._release

    def watch(rec):
        if rec.device_tensor is not None:
            released.append((rec.name, StorageWeakRef(rec.device_tensor.untyped_storage())))
        release(rec)

    engine.parts.coordinator._release = watch
    ids = batches(1, seed=21)[0]
    loss = engine(ids, ids)
    assert len(released) > 10
    assert [name for name, ref in released if not ref.expired()] == []
    engine.backward(loss)
    engine.step()
    ref, _ = run_reference(model, [ids])
    torch.testing.assert_close(loss.item(), ref[0])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_saved_views_of_aliased_weights_are_stored_by_reference(checkpointing):
    """On the CPU device a gathered weight is a range of the optimizer's flat buffer, shared
    with every other weight: a view autograd saves must still be matched to its parameter
    (by address), so backward gathers it again instead of reading a released one."""
    torch.manual_seed(0)
    model = tiny_gpt(layers=2, hidden=32, checkpointing=checkpointing)
    cfg = config(stage3_max_live_parameters=3000, stage3_max_reuse_distance=0)
    engine = infinity.initialize(copy.deepcopy(model), cfg)
    flat = engine.parts.optimizer.weights.flat
    assert any(r.home.flat.data_ptr() != flat.data_ptr() for r in engine.parts.records)
    packed, raw = [], []
    pack = engine.parts.hooks._pack

    def watch(t):
        out = pack(t)
        if out is t:
            raw.append(t)
        else:
            packed.append((out, out.rec.aliased))
        return out

    engine.parts.hooks._pack = watch
    ids = batches(1, seed=21)[0]
    loss = engine(ids, ids)
    engine.backward(loss)
    engine.step()
    assert packed and {aliased for _, aliased in packed} == {True}
    shared = flat.untyped_storage().data_ptr()
    assert [t for t in raw if t.untyped_storage().data_ptr() == shared] == []
    # Each matched to its own parameter (the weight, or its transpose for F.linear).
    assert all(sorted(s.size) == sorted(s.rec.shape) for s, _ in packed)
    ref, _ = run_reference(model, [ids])
    torch.testing.assert_close(loss.item(), ref[0])
