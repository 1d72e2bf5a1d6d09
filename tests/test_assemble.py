"""The engine's assembly: one order, one direction. The flat layout is computed once, the
disk is laid out by an explicit call, the optimizer's new weights go straight down to the
coordinator, and a start that fails removes what it had installed, whichever step fails."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from _engine_models import batches, config, tiny_gpt

import infinity
import infinity.assemble
from infinity.assemble import GatheredRefresh
from infinity.zero.sub_groups import flat_layout
from infinity.zero.weights import NvmeWeights


def _both_on_nvme(tmp_path) -> dict:
    cfg = config(sub_group_size=3000, stage3_param_persistence_threshold=40)
    z = cfg["zero_optimization"]
    z["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    z["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}
    return cfg


def test_nvme_weights_need_the_disk_laid_out_first():
    layout = flat_layout([10, 20], 4096)
    store = types.SimpleNamespace(flat=None)  # a parameter tier whose extent was never laid out
    with pytest.raises(ValueError, match=r"lay_out_flat\(store, layout, names, dtype\)"):
        NvmeWeights(store, layout, ["a", "b"], torch.float16)


def test_one_layout_and_new_weights_flow_down(tmp_path):
    torch.manual_seed(0)
    engine = infinity.initialize(tiny_gpt(checkpointing=False), _both_on_nvme(tmp_path))
    optimizer = engine.parts.optimizer
    # The layout the homes were made with is the optimizer's: computed once.
    assert optimizer.layout is optimizer.weights.layout
    assert engine.parts.param_tier.flat.total == optimizer.layout.total
    refresh = optimizer.on_new_weights
    assert isinstance(refresh, GatheredRefresh) and refresh.coordinator is engine.parts.coordinator
    assert refresh.trainable == [r for r in engine.parts.records if r.trainable]
    seen = []
    refresh_rec = engine.parts.coordinator.refresh
    engine.parts.coordinator.refresh = lambda rec, *a, **k: (
        seen.append(rec),
        refresh_rec(rec, *a, **k),
    )
    ids = batches(1)[0]
    engine.backward(engine(ids, ids))
    engine.step()
    persistent = {r for r in engine.parts.records if r.trainable and r.persistent}
    assert persistent and persistent <= set(seen)  # gathered copies took the new weights
    for rec in persistent:
        assert torch.equal(rec.param.detach().reshape(-1), rec.read_full().reshape(-1))
    engine.close()


def test_a_failed_start_removes_the_hooks(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("refused for the test")

    monkeypatch.setattr(infinity.assemble, "install_grad_hooks", refuse)
    model = tiny_gpt(checkpointing=False)
    with pytest.raises(ValueError, match="refused for the test"):
        infinity.initialize(model, _both_on_nvme(tmp_path))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "swap files left behind"


# What each build step opens, as `assemble` names it, and the verb that undoes it.
_OPENS = {
    "SwapStores": "close",
    "make_param_tier": "close",
    "make_state_tier": "close",
    "Coordinator": "abort",
    "make_grad_tier": "close",
    "PartitionedOptimizer": "cancel_ahead",
    "ModelHooks": "remove",
}
_ORDER = [  # the build's order
    "SwapStores", "make_param_tier", "make_state_tier", "make_weights", "partition_model",
    "Coordinator", "make_grad_tier", "PartitionedOptimizer", "ModelHooks", "install_grad_hooks",
]  # fmt: skip


def _observed(monkeypatch, log: list[str]) -> None:
    """Log each part `assemble` opens and each undoing of one."""
    for name, verb in _OPENS.items():
        real = getattr(infinity.assemble, name)

        def make(*args, _real=real, _name=name, _verb=verb, **kwargs):
            part = _real(*args, **kwargs)
            undo = getattr(part, _verb)
            setattr(part, _verb, lambda: (log.append(f"undo {_name}"), undo())[1])
            log.append(f"open {_name}")
            return part

        monkeypatch.setattr(infinity.assemble, name, make)


@pytest.mark.parametrize("failing", _ORDER[1:])
def test_a_build_failing_midway_closes_what_it_opened_in_reverse(tmp_path, monkeypatch, failing):
    log: list[str] = []
    _observed(monkeypatch, log)

    def refuse(*args, **kwargs):
        raise ValueError("refused for the test")

    monkeypatch.setattr(infinity.assemble, failing, refuse)
    model = tiny_gpt(checkpointing=False)
    with pytest.raises(ValueError, match="refused for the test"):
        infinity.initialize(model, _both_on_nvme(tmp_path))
    before = [n for n in _ORDER[: _ORDER.index(failing)] if n in _OPENS]
    opened = [f"open {n}" for n in before]
    undone = [f"undo {n}" for n in reversed(before)]
    assert log == opened + undone
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "swap files left behind"


def test_a_built_model_closes_in_reverse_once(tmp_path, monkeypatch):
    log: list[str] = []
    _observed(monkeypatch, log)
    engine = infinity.initialize(tiny_gpt(checkpointing=False), _both_on_nvme(tmp_path))
    assert log == [f"open {n}" for n in _OPENS]
    log.clear()
    engine.parts.close()
    engine.parts.close()  # idempotent: nothing is undone twice
    assert log == [f"undo {n}" for n in reversed(_OPENS)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.parts.optimizer = None  # a built value: no part is set afterwards
    engine.close()
