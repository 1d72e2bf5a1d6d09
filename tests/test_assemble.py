"""The engine's assembly: one order, one direction. The flat layout is computed once, the
disk is laid out by an explicit call, the optimizer's new weights go straight down to the
coordinator, and a start that fails removes what it had installed."""

from __future__ import annotations

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
    optimizer = engine.optimizer
    # The layout the homes were made with is the optimizer's: computed once.
    assert optimizer.layout is optimizer.weights.layout
    assert engine.param_tier.flat.total == optimizer.layout.total
    refresh = optimizer.on_new_weights
    assert isinstance(refresh, GatheredRefresh) and refresh.coordinator is engine.coordinator
    assert refresh.trainable == [r for r in engine.records if r.trainable]
    seen = []
    refresh_rec = engine.coordinator.refresh
    engine.coordinator.refresh = lambda rec, *a, **k: (seen.append(rec), refresh_rec(rec, *a, **k))
    ids = batches(1)[0]
    engine.backward(engine(ids, ids))
    engine.step()
    persistent = {r for r in engine.records if r.trainable and r.persistent}
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
