"""A preset's random weights: Hugging Face's rule, drawn on several threads, the same bits
whatever the thread count (see [Note: reproducible parallel init])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity.models.random_init as random_init_mod
from infinity.models import hf_auto
from infinity.models.random_init import init_rule, random_init

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _bare(dtype=torch.float32, **over) -> nn.Module:
    """A transformers Llama built without any init (its values are whatever memory held)."""
    import transformers

    model = hf_auto.build(transformers.LlamaConfig(**{**TINY, **over}), init_weights=False)
    return model.to(dtype)


def _bits(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1000 elements, so every weight spans several generators."""
    monkeypatch.setattr(random_init_mod, "CHUNK_NUMEL", 1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_seed_same_bits_whatever_the_thread_count(small_chunks, dtype):
    runs = []
    for threads in (1, 2, 5):
        model = _bare(dtype)
        assert random_init(model, seed=7, std=0.02, threads=threads)
        runs.append(_bits(model))
    for other in runs[1:]:
        assert all(torch.equal(runs[0][n], other[n]) for n in runs[0])
    model = _bare(dtype)
    random_init(model, seed=8, std=0.02, threads=2)
    assert not torch.equal(_bits(model)["model.layers.0.mlp.up_proj.weight"],
                           runs[0]["model.layers.0.mlp.up_proj.weight"])  # fmt: skip


def test_bf16_weights_are_the_fp32_ones_rounded(small_chunks):
    full, half = _bare(torch.float32), _bare(torch.bfloat16)
    random_init(full, seed=3, std=0.02, threads=2)
    random_init(half, seed=3, std=0.02, threads=3)
    for (name, a), (_, b) in zip(full.named_parameters(), half.named_parameters(), strict=True):
        assert torch.equal(a.detach().to(torch.bfloat16), b.detach()), name


def test_hugging_faces_rule_with_its_spread():
    model = _bare(attention_bias=True)
    rule = init_rule(model)
    assert rule is not None and set(rule) == set(dict(model.named_parameters()))
    random_init(model, seed=0, std=0.05, threads=2)
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(64))
    assert not params["model.layers.1.self_attn.q_proj.bias"].any()
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"):
        w = params[name].detach()
        assert abs(w.mean().item()) < 0.005 and abs(w.std().item() - 0.05) < 0.005, name
    # The layers draw unrelated streams (seeded by name): no two weights of a shape agree.
    q0 = params["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q0, params["model.layers.1.self_attn.q_proj.weight"])


def test_a_padding_row_is_zero():
    model = _bare(pad_token_id=5)
    random_init(model, seed=0, std=0.02, threads=2)
    emb = model.get_input_embeddings().weight.detach()
    assert not emb[5].any() and emb[4].abs().sum() > 0


def test_a_module_the_rule_does_not_know_is_left_to_the_models_own_init():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.full((4,), 3.0))

    model = nn.Sequential(nn.Linear(4, 4), Scale())
    before = _bits(model)
    assert init_rule(model) is None
    assert not random_init(model, seed=0, std=0.02)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_a_preset_built_twice_from_one_seed_is_the_same(tmp_path):
    """`hf_auto.from_pretrained` of a preset, in RAM and through build files on disk."""
    cfg = {"zero_optimization": {"stage": 3}}
    on_disk = {"zero_optimization": {"stage": 3, "offload_param": {"nvme_path": str(tmp_path)}}}
    a = _bits(hf_auto.from_pretrained("tiny", cfg, seed=11))
    b = _bits(hf_auto.from_pretrained("tiny", on_disk, seed=11))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    c = _bits(hf_auto.from_pretrained("tiny", cfg, seed=12))
    assert any(not torch.equal(a[n], c[n]) for n in a)
