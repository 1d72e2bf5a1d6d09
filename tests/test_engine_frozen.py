"""Frozen parameters: read from NVMe once when they fit the live budget, `max_in_cpu` keeps
the first ones in RAM, checkpoints leave them out, name their base and refuse another."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import Zoo, batches, config, run_engine, run_reference, train_steps

import infinity
from infinity.zero import HomeTier


def _frozen_zoo() -> Zoo:
    """Only the adapters and the norm train; every other weight is a frozen base."""
    torch.manual_seed(1)
    model = Zoo(d=16, n=3, lora=True)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or name.startswith("norm"))
    return model


def _nvme_cfg(tmp_path, budget: int, **offload) -> dict:
    cfg = config(stage3_max_live_parameters=budget)
    z = cfg["zero_optimization"]
    z["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), **offload}
    z["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    return cfg


def _frozen_bytes(engine, home=HomeTier.NVME) -> int:
    return sum(
        r.numel * r.itemsize
        for r in engine.parts.records
        if not r.trainable and r.home.tier is home
    )


def test_frozen_base_is_read_once_when_it_fits_the_budget(tmp_path):
    model, data = _frozen_zoo(), batches(6, seed=5)
    ref, _ = run_reference(model, data)
    got, engine = run_engine(model, data[:1], _nvme_cfg(tmp_path, 10**9))
    first = engine.memory_stats()["nvme_param_bytes_read"]
    frozen = _frozen_bytes(engine)
    assert frozen > 0 and first >= frozen
    got += train_steps(engine, data[1:])
    stats = engine.memory_stats()
    # Five more micro-steps: the trainable weights are read again, the frozen base never.
    assert stats["nvme_param_bytes_read"] - first < frozen
    assert stats["live_param_numel"] >= frozen // 4  # the base stays gathered (fp32)
    assert got == pytest.approx(ref, rel=1e-5)
    engine.close()


def test_frozen_base_is_read_again_when_the_budget_is_small(tmp_path):
    model, data = _frozen_zoo(), batches(4, seed=5)
    ref, _ = run_reference(model, data)
    got, engine = run_engine(model, data[:1], _nvme_cfg(tmp_path, 700))
    first = engine.memory_stats()["nvme_param_bytes_read"]
    got += train_steps(engine, data[1:])
    stats = engine.memory_stats()
    assert stats["nvme_param_bytes_read"] - first >= 3 * _frozen_bytes(engine) // 2
    assert stats["peak_live_param_numel"] <= 700 + engine.parts.coordinator.largest_unit
    assert got == pytest.approx(ref, rel=1e-5)
    engine.close()


def test_max_in_cpu_keeps_the_first_frozen_parameters_in_ram(tmp_path):
    model, data = _frozen_zoo(), batches(3, seed=6)
    frozen = [(n, p.numel()) for n, p in model.named_parameters() if not p.requires_grad]
    room = frozen[0][1] + frozen[1][1]  # exactly the first two
    ref, _ = run_engine(model, data, config())
    got, engine = run_engine(model, data, _nvme_cfg(tmp_path, 700, max_in_cpu=room))
    homes = {r.name: r.home.tier for r in engine.parts.records if not r.trainable}
    assert [homes[n] for n, _ in frozen[:2]] == [HomeTier.HOST] * 2
    assert all(homes[n] is HomeTier.NVME for n, _ in frozen[2:])
    assert got == ref
    engine.close()
    got, engine = run_engine(model, data, _nvme_cfg(tmp_path, 700))  # default: none in RAM
    assert all(r.home.tier is HomeTier.NVME for r in engine.parts.records)
    engine.close()


def _trained(tmp_path, cfg, source, **save):
    model, data = _frozen_zoo(), batches(8, seed=7)
    engine = infinity.initialize(copy.deepcopy(model), cfg, base_model=source)
    train_steps(engine, data[:4])
    engine.save_checkpoint(tmp_path / "ckpt", **save)
    return model, data, engine


@pytest.mark.parametrize("nvme", [False, True], ids=["cpu", "nvme"])
def test_checkpoint_holds_only_trainable_weights_and_resume_is_exact(tmp_path, nvme):
    cfg = _nvme_cfg(tmp_path, 10**9) if nvme else config()
    source = {"preset": "zoo", "seed": 1}
    model, data, engine = _trained(tmp_path, cfg, source)
    ckpt = infinity.checkpoint.load_checkpoint(tmp_path / "ckpt")
    params = {n[len("param/") :] for n in ckpt.tensor_names() if n.startswith("param/")}
    assert params == {r.name for r in engine.parts.records if r.trainable}
    assert ckpt.state["base_model"]["source"] == source
    assert "proj.base.weight" in ckpt.state["base_model"]["frozen"]
    expected = train_steps(engine, data[4:])
    engine.close()
    fresh = copy.deepcopy(model)  # the same base; the adapters must come from the file
    with torch.no_grad():
        for p in fresh.parameters():
            if p.requires_grad:
                p.mul_(-3.0)
    resumed = infinity.initialize(fresh, cfg, base_model=source)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert train_steps(resumed, data[4:]) == expected
    resumed.close()


def test_resume_on_another_base_is_refused(tmp_path):
    model, _, engine = _trained(tmp_path, config(), {"preset": "zoo", "seed": 1})
    engine.close()
    other = infinity.initialize(copy.deepcopy(model), config(), base_model={"preset": "zoo"})
    with pytest.raises(ValueError, match=r"different base model.*seed 1") as err:
        other.load_checkpoint(tmp_path / "ckpt")
    assert "another save directory" in str(err.value)
    bigger = Zoo(d=16, n=4, lora=True)  # one more frozen block
    for name, p in bigger.named_parameters():
        p.requires_grad_("lora_" in name or name.startswith("norm"))
    other = infinity.initialize(bigger, config(), base_model={"preset": "zoo", "seed": 1})
    with pytest.raises(ValueError, match=r"not in the checkpoint's base, e.g. 'blocks.3"):
        other.load_checkpoint(tmp_path / "ckpt")


def test_resume_checks_the_base_directory_fingerprints(tmp_path):
    from safetensors.torch import save_file

    base = tmp_path / "base"
    base.mkdir()
    save_file({"w": torch.arange(100.0)}, base / "model.safetensors")
    model, _, engine = _trained(tmp_path, config(), base)
    engine.close()
    record = infinity.checkpoint.load_checkpoint(tmp_path / "ckpt").state["base_model"]
    assert record["source"]["path"] == str(base.resolve())
    same = infinity.initialize(copy.deepcopy(model), config(), base_model=base)
    same.load_checkpoint(tmp_path / "ckpt")  # unchanged: accepted
    same.close()
    save_file({"w": torch.arange(100.0) + 1}, base / "model.safetensors")  # other weights
    other = infinity.initialize(copy.deepcopy(model), config(), base_model=base)
    with pytest.raises(ValueError, match=r"shard\(s\) \['model.safetensors'\] differ"):
        other.load_checkpoint(tmp_path / "ckpt")


def test_include_frozen_writes_the_base_and_needs_no_record(tmp_path):
    model, data, engine = _trained(tmp_path, config(), None, include_frozen=True)
    ckpt = infinity.checkpoint.load_checkpoint(tmp_path / "ckpt")
    assert "param/proj.base.weight" in ckpt.tensor_names()
    assert "base_model" not in ckpt.state
    expected = train_steps(engine, data[4:])
    resumed = infinity.initialize(_frozen_zoo().apply(_scramble), config())
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert train_steps(resumed, data[4:]) == expected


def _scramble(module):
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            p.add_(0.5)
