"""LoRA through peft on Infinity: training matches plain peft + torch AdamW, the merged
weights give peft's merged logits, the adapter directory loads in peft, bad specs are named."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import train_steps
from _train_inputs import TINY

import infinity
from infinity.models import LlamaConfig, LlamaForCausalLM
from infinity.models.lora import (
    LoraSpec,
    apply_lora,
    base_name,
    block_linear_names,
    lora_targets,
    merged_weights,
    write_adapter,
)

peft = pytest.importorskip("peft")

BLOCK_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _cfg(tmp_path=None, accum: int = 1) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 10**9},
    }
    if tmp_path is not None:  # both offloads on NVMe, a budget below the model
        z = cfg["zero_optimization"]
        z["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
        z["stage3_max_live_parameters"] = 6000
    return cfg


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, TINY["vocab_size"], (2, 12), generator=g) for _ in range(n)]


def _nonzero_adapters(model) -> None:
    """peft starts B at zero; make both factors matter from the first step."""
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _reference(spec: LoraSpec, data, accum: int):
    torch.manual_seed(0)
    model = apply_lora(LlamaForCausalLM(LlamaConfig(**TINY)), spec)
    _nonzero_adapters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    losses = []
    for i in range(0, len(data), accum):
        for ids in data[i : i + accum]:
            loss = model(ids, ids)
            (loss / accum).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, model


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_lora_on_infinity_matches_peft_with_adamw(tmp_path, where):
    spec = LoraSpec(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    data, accum = _batches(6), 2
    ref_losses, ref = _reference(spec, data, accum)
    cfg = _cfg(tmp_path if where == "nvme" else None, accum)
    torch.manual_seed(0)
    with infinity.init(cfg):
        model = apply_lora(LlamaForCausalLM(LlamaConfig(**TINY)), spec)
    _nonzero_adapters(model)
    engine = infinity.initialize(model, cfg)
    trainable = {r.name for r in engine.parts.records if r.trainable}
    assert trainable == {n for n, p in ref.named_parameters() if p.requires_grad}
    assert (
        all("lora_" in n for n in trainable) and len(trainable) == 2 * 3 * TINY["num_hidden_layers"]
    )
    losses = train_steps(engine, data)
    assert engine.global_steps == 3
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    want = dict(ref.named_parameters())
    for name, value in engine.named_parameters_host():
        torch.testing.assert_close(value, want[name].detach(), rtol=1e-5, atol=1e-6)
    engine.close()


def test_default_targets_are_the_block_linears_and_bad_specs_are_named():
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    assert block_linear_names(model) == BLOCK_LINEARS  # lm_head is not in a block
    assert lora_targets(model, LoraSpec(r=2)) == BLOCK_LINEARS
    with pytest.raises(ValueError, match=r"\['qproj'\] are not linear layers.*'q_proj'"):
        lora_targets(model, LoraSpec(r=2, targets=("qproj",)))
    with pytest.raises(ValueError, match="positive whole number, got 0"):
        LoraSpec(r=0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        LoraSpec(r=2, dropout=1.0)
    with pytest.raises(ValueError, match="alpha must be positive"):
        LoraSpec(r=2, alpha=-1.0)
    spec = LoraSpec(r=4, alpha=2.0, dropout=0.1, targets=("q_proj",))
    assert LoraSpec.from_dict(spec.to_dict()) == spec and spec.scaling == 0.5


def _trained_peft(spec: LoraSpec):
    torch.manual_seed(2)
    model = apply_lora(LlamaForCausalLM(LlamaConfig(**TINY)), spec)
    _nonzero_adapters(model)
    return model.eval()


def test_merged_weights_give_peft_merged_logits():
    spec = LoraSpec(r=4, alpha=16)
    model = _trained_peft(spec)
    base = {
        base_name(n): p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n
    }
    adapters = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    merged = dict(merged_weights(base.items(), adapters, spec))
    ids = _batches(1)[0]
    with torch.no_grad():
        want = model(ids)
        plain = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
        plain.load_state_dict(merged, strict=False)
        plain.tie_weights()
        torch.testing.assert_close(plain(ids), want, rtol=1e-5, atol=1e-5)
        peft_merged = copy.deepcopy(model).merge_and_unload()
        for name, p in peft_merged.named_parameters():
            torch.testing.assert_close(merged[name], p, rtol=1e-6, atol=1e-6)


def test_adapter_directory_loads_in_peft(tmp_path):
    spec = LoraSpec(r=4, alpha=8, targets=("q_proj", "up_proj"))
    model = _trained_peft(spec)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    out = write_adapter(tmp_path / "adapter", spec, ["q_proj", "up_proj"], named)
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    torch.manual_seed(2)
    fresh = LlamaForCausalLM(LlamaConfig(**TINY)).eval()  # the same base weights
    loaded = peft.PeftModel.from_pretrained(fresh, out).eval()
    ids = _batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))
    with pytest.raises(ValueError, match="exists"):
        write_adapter(out, spec, ["q_proj"], named)
    with pytest.raises(ValueError, match="no LoRA adapter weights"):
        write_adapter(tmp_path / "none", spec, ["q_proj"], [("w", torch.zeros(2))])
    assert not (tmp_path / "none").exists() and not (tmp_path / ".tmp.none").exists()


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_lora_with_activation_checkpointing_under_a_small_budget_matches_peft(tmp_path, where):
    """The frozen base weights a recomputed block saves (a norm's weight is saved as the
    parameter itself) stay valid after the budget evicts them: the checkpoint's metadata
    check passes and backward reads the recomputed values."""
    spec = LoraSpec(r=4, alpha=8)
    data, accum = _batches(4), 2
    ref_losses, ref = _reference(spec, data, accum)
    cfg = _cfg(tmp_path, accum)
    if where == "cpu":
        z = cfg["zero_optimization"]
        z["offload_param"] = z["offload_optimizer"] = {"device": "cpu"}
    torch.manual_seed(0)
    with infinity.init(cfg):
        model = apply_lora(LlamaForCausalLM(LlamaConfig(**TINY)), spec)
    _nonzero_adapters(model)
    model.set_gradient_checkpointing(True)
    engine = infinity.initialize(model, cfg)
    losses = train_steps(engine, data)
    assert engine.memory_stats()["budget_overruns"] == 0
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    want = dict(ref.named_parameters())
    for name, value in engine.named_parameters_host():
        torch.testing.assert_close(value, want[name].detach(), rtol=1e-5, atol=1e-6)
    engine.close()
