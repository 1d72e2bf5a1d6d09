"""Engine checkpoints: an interrupted run resumes exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import Zoo, batches, config, train_steps

import infinity


@pytest.mark.parametrize("include_frozen", [False, True], ids=["base-left-out", "with-base"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_save_then_resume_is_exact(tmp_path, precision, include_frozen):
    torch.manual_seed(0)
    model = Zoo(lora=True)
    model.proj.base.requires_grad_(False)  # frozen weights are saved from their homes
    cfg = config(stage3_param_persistence_threshold=20)
    cfg["gradient_accumulation_steps"] = 2
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    data = batches(12, seed=20)
    engine = infinity.initialize(copy.deepcopy(model), cfg)
    train_steps(engine, data[:6])
    tag = engine.save_checkpoint(tmp_path, include_frozen=include_frozen)
    after_save = torch.rand(3)
    expected = train_steps(engine, data[6:])
    if include_frozen:
        fresh = Zoo(lora=True)  # different random weights: everything must come from the file
    else:  # the same frozen base, different trainable weights
        fresh = copy.deepcopy(model)
        with torch.no_grad():
            for p in fresh.parameters():
                if p.requires_grad:
                    p.add_(1.0)
    resumed = infinity.initialize(fresh, cfg)
    path, client_state = resumed.load_checkpoint(tmp_path)
    assert path.endswith(tag) and client_state == {}
    torch.testing.assert_close(torch.rand(3), after_save)  # RNG restored
    assert resumed.global_steps == 3 and resumed.micro_steps == 6
    got = train_steps(resumed, data[6:])
    assert got == expected
    for (n, a), (_, b) in zip(
        engine.named_parameters_host(), resumed.named_parameters_host(), strict=True
    ):
        assert torch.equal(a, b), n


def test_load_refuses_another_model(tmp_path):
    engine = infinity.initialize(Zoo(), config())
    engine.save_checkpoint(tmp_path, tag="a")
    other = infinity.initialize(Zoo(n=2), config())
    with pytest.raises(ValueError):
        other.load_checkpoint(tmp_path, "a")
