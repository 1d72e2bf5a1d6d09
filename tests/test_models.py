"""The Llama model: HF names and numerics, streaming load, export, errors, presets."""

from __future__ import annotations

import json

import pytest
import torch
from _engine_models import SMALL_LLAMA, random_ids

from infinity.models import (
    LlamaConfig,
    LlamaForCausalLM,
    expected_shapes,
    export_hf,
    from_pretrained_dir,
    param_shapes,
    preset,
    stream_hf_weights,
)

HF_NAMES_LAYER0 = {
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
}


def test_parameter_names_match_hf_layout():
    model = LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA))
    names = set(dict(model.named_parameters()))
    assert names >= HF_NAMES_LAYER0
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert len(names) == 3 + 9 * 2
    tied = LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA, tie_word_embeddings=True))
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["tiny", "llama-1b", "llama-7b", "llama-13b"])
def test_presets_count_parameters(name):
    cfg = preset(name)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    if name == "llama-7b":
        assert 6.7e9 < cfg.num_params < 6.8e9
        # 6N dominates; the untied input embedding is not a matmul
        n_matmul = cfg.num_params - cfg.vocab_size * cfg.hidden_size
        assert cfg.train_flops_per_token(2048) == 6 * n_matmul + 12 * 32 * 4096 * 2048


def test_loss_and_activation_checkpointing_match():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA)).train()
    ids = random_ids(300)
    labels = random_ids(300, seed=1)
    loss = model(ids, labels)
    ref = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(loss, ref)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_gradient_checkpointing(True)
    model(ids, labels).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        from_pretrained_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        from_pretrained_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**SMALL_LLAMA, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        from_pretrained_dir(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        from_pretrained_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(SMALL_LLAMA))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="pickle-based weights are not loaded"):
        from_pretrained_dir(tmp_path)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("llama-70b")


def _export_ours(tmp_path, cfg, **kw):
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).eval()
    out = export_hf(model.named_parameters(), cfg, tmp_path / "out", **kw)
    return model, out


def test_export_shards_index_and_round_trip(tmp_path):
    cfg = LlamaConfig(**SMALL_LLAMA, tie_word_embeddings=True)
    model, out = _export_ours(tmp_path, cfg, dtype="fp32", max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 2 and files[0] == f"model-00001-of-{n:05d}.safetensors"
    assert "lm_head.weight" not in index["weight_map"]
    assert not list(tmp_path.glob(".tmp*"))
    loaded = from_pretrained_dir(out).eval()
    ids = random_ids(300)
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with pytest.raises(FileExistsError, match="already exists"):
        export_hf(model.named_parameters(), cfg, out)


def test_export_bf16_single_file_and_failure_leaves_nothing(tmp_path):
    cfg = LlamaConfig(**SMALL_LLAMA)
    _, out = _export_ours(tmp_path, cfg)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = from_pretrained_dir(out, dtype=torch.bfloat16)
    assert loaded.model.norm.weight.dtype == torch.bfloat16

    def entries():
        yield "a", torch.ones(3)
        raise RuntimeError("swap-in failed")

    with pytest.raises(RuntimeError, match="swap-in failed"):
        export_hf(entries(), cfg, tmp_path / "broken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(ValueError, match="export dtype"):
        export_hf([], cfg, tmp_path / "x", dtype="int8")


def test_sink_receives_each_tensor_once_and_mismatches_are_named(tmp_path):
    cfg = LlamaConfig(**SMALL_LLAMA)
    model, out = _export_ours(tmp_path, cfg, dtype="fp32", max_shard_bytes=100_000)
    seen = {}
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    assert param_shapes(cfg) == expected_shapes(meta)
    n = stream_hf_weights(out, param_shapes(cfg), lambda k, t: seen.setdefault(k, t.sum()))
    assert n == len(seen) == len(expected_shapes(meta))
    sunk = from_pretrained_dir(out, sink=lambda k, t: None)
    assert all(p.is_meta for p in sunk.parameters())
    assert all(p.is_meta for p in meta.parameters())  # a custom sink owns the data
    ref = dict(model.named_parameters())
    assert all(torch.allclose(seen[k], ref[k].sum()) for k in seen)

    # a rank's shard: the second third of every flattened tensor, nothing else read
    def third(name, shape):
        n = torch.Size(shape).numel()
        size = -(-n // 3)
        return size, min(size, n - size)

    parts = {}
    stream_hf_weights(out, param_shapes(cfg), parts.__setitem__, part=third)
    for k, v in ref.items():
        start, numel = third(k, v.shape)
        assert torch.equal(parts[k], v.detach().reshape(-1)[start : start + numel]), k

    bigger = LlamaConfig(**{**SMALL_LLAMA, "intermediate_size": 128})
    (out / "config.json").write_text(json.dumps(bigger.to_hf_dict()))
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.gate_proj.weight'.*\[120, 64\].*implies \[128, 64\]"
    ):
        from_pretrained_dir(out)
    deeper = LlamaConfig(**{**SMALL_LLAMA, "num_hidden_layers": 3})
    (out / "config.json").write_text(json.dumps(deeper.to_hf_dict()))
    with pytest.raises(ValueError, match=r"missing 9 tensor\(s\) \['model.layers.2"):
        from_pretrained_dir(out)
    shallower = LlamaConfig(**{**SMALL_LLAMA, "num_hidden_layers": 1})
    (out / "config.json").write_text(json.dumps(shallower.to_hf_dict()))
    with pytest.raises(ValueError, match=r"unexpected 9 tensor\(s\) \['model.layers.1"):
        from_pretrained_dir(out)


def test_truncated_hf_shard_is_named(tmp_path):
    cfg = LlamaConfig(**SMALL_LLAMA)
    _, out = _export_ours(tmp_path, cfg, dtype="fp32", max_shard_bytes=100_000)
    shard = sorted(out.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{shard.name} is truncated"):
        from_pretrained_dir(out)
