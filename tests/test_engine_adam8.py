"""The 8-bit optimizer through the engine: every tier (RAM, NVMe, split) and sub-group size
gives the same bits, the NVMe state moves about half the bytes of 32-bit Adam's, checkpoints
resume exactly, and a checkpoint of the other format is refused unless converted."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import batches, config, run_engine, tiny_gpt, train_steps

import infinity
from infinity.checkpoint import load_checkpoint


def _cfg(tmp_path, device: str = "cpu", *, eight_bit: bool = True, **offload) -> dict:
    if device == "nvme":
        tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = config(sub_group_size=4096)  # several sub-groups: the pipeline really runs
    cfg["optimizer"]["type"] = "AdamW8bit" if eight_bit else "AdamW"
    cfg["zero_optimization"]["offload_optimizer"] = {
        "device": device, "nvme_path": str(tmp_path), **offload,
    }  # fmt: skip
    cfg["gradient_clipping"] = 1.0
    cfg["bf16"] = {"enabled": True}
    return cfg


def _same_weights(a, b) -> None:
    for (name, x), (_, y) in zip(a.named_parameters_host(), b.named_parameters_host(), strict=True):
        assert torch.equal(x, y), name


def test_every_tier_and_sub_group_size_gives_the_same_bits(tmp_path):
    torch.manual_seed(0)
    model, data = tiny_gpt(checkpointing=False), batches(5, seed=3)
    ref_losses, ref = run_engine(model, data, _cfg(tmp_path / "unused"))
    assert ref.parts.optimizer.format.eight_bit
    runs = {
        "nvme": _cfg(tmp_path / "a", "nvme"),
        "split": _cfg(tmp_path / "b", "nvme", max_in_cpu=8192),
        "one sub-group": {**_cfg(tmp_path / "c"), "zero_optimization": {
            **_cfg(tmp_path / "c")["zero_optimization"], "sub_group_size": 10**7}},
    }  # fmt: skip
    for name, cfg in runs.items():
        losses, engine = run_engine(model, data, cfg)
        assert losses == ref_losses, name
        _same_weights(engine, ref)
        engine.close()
    ref.close()


def test_nvme_bytes_are_about_half_of_32_bit(tmp_path):
    """A steady step's optimizer reads (the last step's: runs of 3 and 4 steps apart; the
    first state's reads take the master alone, see [Note: moments never written])."""
    torch.manual_seed(0)
    model, data = tiny_gpt(checkpointing=False), batches(4, seed=1)
    read = {}
    for eight_bit in (False, True):
        total = []
        for steps in (3, 4):
            path = tmp_path / f"{eight_bit}-{steps}"
            path.mkdir()
            cfg = _cfg(path, "nvme", eight_bit=eight_bit)
            cfg["zero_optimization"]["sub_group_size"] = 32768  # pages of padding stay small
            _, engine = run_engine(model, data[:steps], cfg)
            total.append(engine.memory_stats()["nvme_optim_bytes_read"])
            numel = sum(r.numel for r in engine.parts.records if r.trainable)
            engine.close()
        read[eight_bit] = total[1] - total[0]
    assert read[True] <= 0.55 * read[False], read
    # 6 bytes and 1/32 per element, padding included.
    assert read[True] >= 6 * numel


def test_checkpoint_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    model, data = tiny_gpt(checkpointing=False), batches(6, seed=5)
    (tmp_path / "swap").mkdir()
    cfg = _cfg(tmp_path / "swap", "nvme", max_in_cpu=8192)
    straight = infinity.initialize(copy.deepcopy(model), cfg)
    want = train_steps(straight, data)
    first = infinity.initialize(copy.deepcopy(model), cfg)
    train_steps(first, data[:3])
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    saved = load_checkpoint(tmp_path / "ckpt")
    codes = [n for n in saved.tensor_names() if n.endswith(".exp_avg")]
    assert codes and all(saved.get_tensor(n).dtype == torch.uint8 for n in codes)
    assert any(n.endswith(".exp_avg_sq_absmax") for n in saved.tensor_names())
    resumed = infinity.initialize(copy.deepcopy(model), _cfg(tmp_path / "swap"))  # RAM tier
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert want[3:] == train_steps(resumed, data[3:])
    _same_weights(resumed, straight)
    for e in (straight, resumed):
        e.close()


@pytest.mark.parametrize("saved_8bit", [True, False])
def test_the_other_format_is_refused_unless_converted(tmp_path, saved_8bit):
    torch.manual_seed(0)
    model, data = tiny_gpt(checkpointing=False), batches(4, seed=2)
    first = infinity.initialize(copy.deepcopy(model), _cfg(tmp_path, eight_bit=saved_8bit))
    train_steps(first, data[:2])
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    other = _cfg(tmp_path, eight_bit=not saved_8bit)
    engine = infinity.initialize(copy.deepcopy(model), other)
    with pytest.raises(ValueError, match="--convert-optim-state") as err:
        engine.load_checkpoint(tmp_path / "ckpt")
    # The fix in every switch's words: the CLI's, the config's and the Trainer's.
    saved = "'AdamW8bit'" if saved_8bit else "'AdamW'"
    assert f"optimizer.type {saved}" in str(err.value)
    assert ("optim='adamw_bnb_8bit'" if saved_8bit else "optim='adamw_torch'") in str(err.value)
    engine.close()
    other["optimizer"]["params"]["convert_state"] = True
    engine = infinity.initialize(copy.deepcopy(model), other)
    engine.load_checkpoint(tmp_path / "ckpt")
    losses = train_steps(engine, data[2:])
    # The same run continued in its own format learns alike (the moments were converted).
    same = infinity.initialize(copy.deepcopy(model), _cfg(tmp_path, eight_bit=saved_8bit))
    same.load_checkpoint(tmp_path / "ckpt")
    want = train_steps(same, data[2:])
    assert losses == pytest.approx(want, rel=2e-2)
    for e in (engine, same):
        e.close()


def test_memory_stats_say_the_state_format(tmp_path):
    """The engine's `memory_stats()` carries `optim_state_bits`, as docs/optimizer_8bit.md
    says (the optimizer's own stats had it; the engine's dropped it)."""
    for eight_bit, bits in ((True, 8), (False, 32)):
        engine = infinity.initialize(
            tiny_gpt(checkpointing=False), _cfg(tmp_path, eight_bit=eight_bit)
        )
        try:
            assert engine.memory_stats()["optim_state_bits"] == bits
        finally:
            engine.close()
