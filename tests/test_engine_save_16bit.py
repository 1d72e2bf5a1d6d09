"""gather_16bit_weights_on_model_save and Engine.save_16bit_model: one consolidated 16-bit
safetensors file that transformers loads, written atomically."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import batches, config, tiny_gpt
from safetensors.torch import load_file

import infinity
import infinity.checkpoint.model16 as model16


def _engine(tmp_path, *, gather: bool, precision: str = "bf16", nvme: bool = False):
    cfg = config()
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if nvme:
        swap = tmp_path / "swap"
        swap.mkdir()
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(swap)}
    torch.manual_seed(0)
    engine = infinity.initialize(copy.deepcopy(tiny_gpt(checkpointing=False)), cfg)
    for ids in batches(2, seed=5):
        engine.backward(engine(ids, ids))
        engine.step()
    return engine


def test_without_the_key_the_error_names_it_and_the_export_command(tmp_path):
    engine = _engine(tmp_path, gather=False)
    with pytest.raises(
        ValueError,
        match=r"stage3_gather_16bit_weights_on_model_save is false; set it to true, or export "
        r"a checkpoint with `infinity export CKPT --out DIR`",
    ):
        engine.save_16bit_model(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    engine.close()


@pytest.mark.parametrize(
    "precision,nvme,dtype",
    [
        ("bf16", False, torch.bfloat16),
        ("fp16", False, torch.float16),
        ("fp32", True, torch.bfloat16),
    ],
)
def test_saved_weights_are_the_engines_in_16_bits_and_load_in_transformers(
    tmp_path, precision, nvme, dtype
):
    transformers = pytest.importorskip("transformers")
    engine = _engine(tmp_path, gather=True, precision=precision, nvme=nvme)
    path = engine.save_16bit_model(tmp_path / "out")
    assert path == str(tmp_path / "out" / "model.safetensors")
    saved = load_file(path)
    host = dict(engine.named_parameters_host())
    assert set(host) <= set(saved)
    for name, weights in host.items():
        assert saved[name].dtype == dtype, name
        assert torch.equal(saved[name], weights.to(dtype)), name
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    loaded = dict(model.named_parameters())
    assert torch.equal(loaded["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    engine.close()


def test_a_failed_save_leaves_the_previous_file(tmp_path, monkeypatch):
    engine = _engine(tmp_path, gather=True)
    path = engine.save_16bit_model(tmp_path / "out", "weights.safetensors")
    before = (tmp_path / "out" / "weights.safetensors").read_bytes()
    real_add, calls = model16.StreamingSafetensorsWriter.add, []

    def failing_add(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real_add(self, name, tensor)

    monkeypatch.setattr(model16.StreamingSafetensorsWriter, "add", failing_add)
    with pytest.raises(OSError, match="No space left"):
        engine.save_16bit_model(tmp_path / "out", "weights.safetensors")
    assert (tmp_path / "out" / "weights.safetensors").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "weights.safetensors",
    ]
    assert path.endswith("weights.safetensors")
    engine.close()


def test_save_filename_must_be_a_plain_name(tmp_path):
    engine = _engine(tmp_path, gather=True)
    with pytest.raises(ValueError, match=r"save_filename 'a/b.safetensors' must be a plain file"):
        engine.save_16bit_model(tmp_path / "out", "a/b.safetensors")
    engine.close()
