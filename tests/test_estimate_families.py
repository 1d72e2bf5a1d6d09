"""`infinity.estimate` for every family `infinity train` takes through transformers (Qwen2,
Mistral, Gemma, Phi3, GPT-2): the shape is the built model's parameters, the sizes are read
through one adapter, and the bytes equal the engine's counters on tiny models of each."""

from __future__ import annotations

import pathlib

import pytest
import torch
from _hf_models import hf_config
from _resolve import resolve_config
from test_estimate import _config, _delta, _swap_file_bytes

import infinity
from infinity.config import Config
from infinity.estimate import model_shape, sizes
from infinity.estimate.dims import model_dims
from infinity.models import LlamaConfig, hf_auto
from infinity.models.lora import LoraSpec, apply_lora

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen2", "mistral", "gemma", "phi3", "gpt2")
VOCAB = 320


def _hf(arch: str, **keys):
    return hf_config(transformers, arch, vocab=VOCAB, **keys)


@pytest.mark.parametrize("arch", FAMILIES)
def test_shape_is_the_built_models_parameters_in_order(arch):
    cfg = _hf(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    shape = model_shape(cfg)
    assert [(p.name, p.numel) for p in shape.params] == [
        (n, p.numel()) for n, p in model.named_parameters()
    ]  # tied weights once, in the engine's record order
    first = shape.units[0].name
    assert first in ("model.embed_tokens", "transformer.wte")
    assert shape.units[-1].name == "lm_head" or arch == "qwen2"  # qwen2's head is tied
    assert {u.block for u in shape.units} - {None} == {
        f"{'transformer.h' if arch == 'gpt2' else 'model.layers'}.{i}" for i in range(2)
    }


def test_gpt2_sizes_are_read_through_its_own_names():
    d = model_dims(_hf("gpt2"))  # n_embd, n_layer, n_head; n_inner unset: 4 x hidden
    assert (d.hidden_size, d.num_hidden_layers, d.num_attention_heads) == (32, 2, 4)
    assert (d.intermediate_size, d.num_key_value_heads, d.head_dim) == (128, 4, 8)
    assert d.stand_in().intermediate_size == 128
    assert model_dims(_hf("gemma")).head_dim == 8


def test_a_family_without_the_sizes_is_named():
    cfg = transformers.PretrainedConfig(vocab_size=10)
    with pytest.raises(ValueError, match="cannot read hidden_size, num_hidden_layers"):
        model_dims(cfg)


def test_flops_count_matmuls_as_the_llama_config_does():
    sizes_ = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    llama = LlamaConfig(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, **sizes_)
    assert model_shape(llama).train_flops_per_token(16) == llama.train_flops_per_token(16)
    gpt2 = model_shape(_hf("gpt2"))  # wte and wpe are lookups; lm_head is tied to wte
    lookups = 32 * 64  # wpe: positions x hidden
    assert gpt2.matmul_numel == gpt2.numel - lookups
    assert gpt2.train_flops_per_token(16) > 6 * gpt2.matmul_numel


def test_lora_adapts_what_peft_adapts_and_gpt2_is_refused_as_train_refuses_it():
    for arch in ("qwen2", "phi3"):
        cfg = _hf(arch)
        peft_model = apply_lora(transformers.AutoModelForCausalLM.from_config(cfg), LoraSpec(r=4))
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        shape = model_shape(cfg, lora_r=4)
        assert shape.trainable_numel == trainable
        assert shape.numel == sum(p.numel() for p in peft_model.parameters())
    with pytest.raises(ValueError, match="no linear layer inside a block"):
        model_shape(_hf("gpt2"), lora_r=4)


def _train(arch: str, cfg: dict, path: pathlib.Path, *, lora_r=0, checkpointing=False):
    """memory_stats() after build and after each of 3 optimizer steps; swap file bytes."""
    torch.manual_seed(0)
    with infinity.init(cfg):
        model = hf_auto.build(_hf(arch))
        if lora_r:
            model = apply_lora(model, LoraSpec(r=lora_r))
    if checkpointing:
        hf_auto.enable_activation_checkpointing(model)
    engine = infinity.initialize(model, cfg)
    try:
        stats, disk = [engine.memory_stats()], _swap_file_bytes(path)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _ in range(cfg["gradient_accumulation_steps"]):
                ids = torch.randint(0, VOCAB, (2, 12), generator=g)
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
            stats.append(engine.memory_stats())
    finally:
        engine.close()
    return stats, disk


CASES = {
    **{f"{a}-small-budget": dict(arch=a) for a in FAMILIES},
    "qwen2-lora-biased-qkv": dict(arch="qwen2", lora_r=4, param="cpu"),
    "phi3-lora-fused-qkv-over-budget": dict(arch="phi3", lora_r=4, budget=12000),
    # transformers' blocks: the last module's backward before the block is recomputed
    "mistral-checkpointed-accum": dict(arch="mistral", checkpointing=True, accum=2),
    # ... and a weight evicted before its bias when both are next used together
    "gpt2-checkpointed-accum": dict(arch="gpt2", checkpointing=True, accum=2),
    "qwen2-checkpointed": dict(arch="qwen2", checkpointing=True),
    "gemma-params-cpu-fp32": dict(arch="gemma", param="cpu", dtype="fp32"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bytes_equal_the_engine_counters(tmp_path, case):
    spec = dict(CASES[case])
    arch, lora_r = spec.pop("arch"), spec.pop("lora_r", 0)
    ckpt = spec.pop("checkpointing", False)
    budget = spec.pop("budget", 9000)
    cfg = _config(tmp_path, stage3_max_live_parameters=budget, sub_group_size=6000,
                  stage3_param_persistence_threshold=100, **spec)  # fmt: skip
    stats, disk = _train(arch, cfg, tmp_path, lora_r=lora_r, checkpointing=ckpt)
    shape = model_shape(_hf(arch), lora_r=lora_r)
    sz = sizes(shape, resolve_config(Config.load(cfg), shape), pins=False, checkpointing=ckpt)
    accum = cfg["gradient_accumulation_steps"]
    assert stats[-1]["host_bytes"] == sz.host_bytes
    assert stats[-1]["pinned_bytes"] == sz.pinned_bytes
    assert disk == sz.nvme_bytes
    reads = accum * sz.param_read_bytes_per_micro_step
    assert _delta(stats, "nvme_param_bytes_read") == reads
    assert (reads > 0) == (spec.get("param", "nvme") == "nvme")
    for kind, want in (
        ("optim_bytes_read", sz.optim_read_bytes_per_step),
        ("optim_bytes_written", sz.optim_write_bytes_per_step),
        ("param_bytes_written", sz.param_write_bytes_per_step),
        ("grad_bytes_read", sz.grad_read_bytes_per_step),
        ("grad_bytes_written", sz.grad_write_bytes_per_step),
    ):
        assert _delta(stats, f"nvme_{kind}") == want, kind
