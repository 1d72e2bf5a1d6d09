"""Hugging Face transformers models, which the engine was not written for, train exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import VOCAB, batches, config, max_rel_diff

import infinity

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_hf_causal_lm_parity(make, checkpointing):
    torch.manual_seed(0)
    model = make()
    if checkpointing:  # the newer name where transformers has it (the old one is deprecated)
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    model.train()
    data = batches(4, seed=30)
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    ref = []
    for ids in data:
        loss = ref_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    total = sum(p.numel() for p in model.parameters())
    budget = total // 3
    engine = infinity.initialize(copy.deepcopy(model), config(stage3_max_live_parameters=budget))
    got = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss  # a ModelOutput, kwargs in
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    assert max_rel_diff(got, ref) < 1e-5, (got, ref)
    stats = engine.memory_stats()
    # The bound: the budget plus the largest unit (a module's own parameters).
    assert stats["peak_live_param_numel"] <= budget + engine.coordinator.largest_unit
    assert stats["budget_overruns"] == 0
