"""Loading a Hugging Face checkpoint through `load_hf_into` (O_DIRECT blocks, tensors copied
out as they land): the same bits and digests as the tensor-by-tensor stream."""

from __future__ import annotations

import pytest
import torch

import infinity.models.hf_read as hf_read
from infinity.models import hf_auto
from infinity.models.hf_load import copying_sink, load_hf_into, stream_hf_weights
from infinity.utils import tensor_digests

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


@pytest.fixture(params=[8192, 1 << 20], ids=["small-blocks", "big-blocks"])
def block(request, monkeypatch):
    """Blocks of 8 KiB (every tensor spans several, each block holds pieces of several) or
    1 MiB; two blocks in flight."""
    monkeypatch.setattr(hf_read, "BLOCK_BYTES", request.param)
    monkeypatch.setattr(hf_read, "DEPTH", 2)


def _checkpoint(tmp_path, dtype):
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(dtype)
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    return tmp_path / "ckpt", model.config


def _bare(config, dtype):
    return hf_auto.build(config, init_weights=False).to(dtype)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("into", [torch.float32, torch.bfloat16])
def test_the_same_bits_and_digests_as_the_stream(tmp_path, monkeypatch, block, stored, into):
    ckpt, config = _checkpoint(tmp_path, stored)
    want = _bare(config, into)
    with torch.no_grad():
        for p in want.parameters():
            p.fill_(float("nan"))  # nothing left unwritten passes
    stream_hf_weights(ckpt, {n: tuple(p.shape) for n, p in want.named_parameters()},
                      copying_sink(want))  # fmt: skip
    digests = dict(tensor_digests.remembered(ckpt / "model.safetensors"))
    got = _bare(config, into)
    with torch.no_grad():
        for p in got.parameters():
            p.fill_(float("nan"))
    monkeypatch.setattr(tensor_digests, "_REMEMBERED", {})  # only what the new path records
    n = load_hf_into(ckpt, dict(got.named_parameters()))
    assert n == len(dict(got.named_parameters()))
    for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert tensor_digests.remembered(ckpt / "model.safetensors") == digests


def test_a_shape_mismatch_is_refused_before_reading(tmp_path):
    ckpt, config = _checkpoint(tmp_path, torch.float32)
    model = _bare(config, torch.float32)
    params = dict(model.named_parameters())
    params["model.norm.weight"] = torch.zeros(65)
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_hf_into(ckpt, params)
