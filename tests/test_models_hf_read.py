"""Loading a Hugging Face checkpoint through `load_hf_into` (O_DIRECT blocks, tensors copied
out as they land): the same bits as the tensor-by-tensor stream and transformers'
from_pretrained, and digests that find a changed byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import infinity.models.hf_read as hf_read
from infinity.checkpoint.base_model import check_tensor
from infinity.io import checksum
from infinity.models import hf_auto
from infinity.models.hf_load import copying_sink, load_hf_into, stream_hf_weights
from infinity.utils import tensor_digests

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


@pytest.fixture(params=[8192, 1 << 20], ids=["small-blocks", "big-blocks"])
def block(request, monkeypatch):
    """Blocks of 8 KiB (every tensor spans several, each block holds pieces of several; every
    piece of 2 bytes or more copied in two halves on two threads) or 1 MiB (every piece on
    one thread: below the split's minimum); two blocks in flight."""
    monkeypatch.setattr(hf_read, "BLOCK_BYTES", request.param)
    monkeypatch.setattr(hf_read, "DEPTH", 2)
    if request.param == 8192:
        monkeypatch.setattr(hf_read, "_SPLIT_MIN_BYTES", 2)


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
    got_digests = tensor_digests.remembered(ckpt / "model.safetensors")
    assert {n: d[:2] for n, d in got_digests.items()} == {n: d[:2] for n, d in digests.items()}
    kinds = {tuple(d[3:]) for d in got_digests.values()}
    assert kinds == ({(tensor_digests.CRC32C,)} if checksum.FAST_CRC32C else {()})
    # each digest holds for the bytes as stored, and not for one bit flipped
    source = {"tensors": {"model.safetensors": got_digests}}
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        for name in got_digests:
            stored_tensor = f.get_tensor(name)
            check_tensor(source, ckpt / "model.safetensors", name, stored_tensor)
            flipped = stored_tensor.clone()
            flipped.reshape(-1).view(torch.uint8)[-1] ^= 1  # the last byte: every byte counts
            with pytest.raises(ValueError, match="changed since the run loaded it"):
                check_tensor(source, ckpt / "model.safetensors", name, flipped)


def test_a_shape_mismatch_is_refused_before_reading(tmp_path):
    ckpt, config = _checkpoint(tmp_path, torch.float32)
    model = _bare(config, torch.float32)
    params = dict(model.named_parameters())
    params["model.norm.weight"] = torch.zeros(65)
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_hf_into(ckpt, params)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("into", [torch.float32, torch.bfloat16])
def test_the_same_bits_as_transformers_from_pretrained(tmp_path, block, stored, into, tied):
    import transformers

    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(config).to(stored).save_pretrained(
        tmp_path / "ckpt", safe_serialization=True
    )
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=into)
    ours = _bare(config, into)
    with torch.no_grad():
        for p in ours.parameters():
            p.fill_(float("nan"))  # nothing left unwritten passes
    load_hf_into(tmp_path / "ckpt", dict(ours.named_parameters()), ignore=hf_auto.aliases(ours))
    want = dict(theirs.named_parameters())
    for name, got in ours.named_parameters():
        assert got.dtype == want[name].dtype == into, name
        bits = torch.int16 if into.itemsize == 2 else torch.int32  # NaNs, signed zeros too
        assert torch.equal(got.view(bits), want[name].view(bits)), name
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied


def test_a_base_record_of_either_checksum_is_checked(monkeypatch, caplog):
    tensor = torch.arange(1000, dtype=torch.float32)
    changed = tensor.clone()
    changed[500] = -1.0
    crc32 = tensor_digests.tensor_crc32(tensor)  # records written before CRC-32C: no kind
    for digest in ([0, 1000, crc32], [0, 1000, checksum.crc32c(tensor), tensor_digests.CRC32C]):
        if len(digest) == 4 and not checksum.FAST_CRC32C:
            continue
        source = {"tensors": {"model.safetensors": {"w": digest}}}
        check_tensor(source, Path("model.safetensors"), "w", tensor)
        with pytest.raises(ValueError, match="changed since the run loaded it"):
            check_tensor(source, Path("model.safetensors"), "w", changed)
    # without the native kernel a CRC-32C record is not summed (hours in Python), but said so
    monkeypatch.setattr(checksum, "FAST_CRC32C", False)
    source = {"tensors": {"model.safetensors": {"w": [0, 1000, 0, tensor_digests.CRC32C]}}}
    with caplog.at_level("WARNING"):
        check_tensor(source, Path("model.safetensors"), "w", changed)
    assert "is not checked" in caplog.text
