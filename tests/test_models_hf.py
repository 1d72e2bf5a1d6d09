"""The Llama model against Hugging Face transformers: same logits both ways."""

from __future__ import annotations

import pytest
import torch

from infinity.models import export_hf, from_pretrained_dir

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=120,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _ids(vocab, B=2, T=17, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[dev]')"
)

HF_VARIANTS = {
    "gqa": {},
    "tied_mha": dict(tie_word_embeddings=True, num_key_value_heads=4),
    "llama3_rope": dict(
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
}


def _hf_model(variant, tmp_path, **save_kw):
    cfg = transformers.LlamaConfig(**{**SMALL, **HF_VARIANTS[variant]})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped name would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True, **save_kw)
    return model


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_hf_checkpoint_loads_with_same_logits(tmp_path, variant):
    hf = _hf_model(variant, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = from_pretrained_dir(tmp_path / "hf").eval()
    ids = _ids(300, T=33)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["gqa", "tied_mha"])
def test_export_loads_in_transformers_with_same_logits(tmp_path, variant):
    _hf_model(variant, tmp_path)
    ours = from_pretrained_dir(tmp_path / "hf").eval()
    out = export_hf(
        ours.named_parameters(), ours.config, tmp_path / "exp", dtype="fp32", max_shard_bytes=50_000
    )
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids = _ids(300, T=29, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
