"""Hugging Face models: Infinity's Llama against transformers (same logits both ways), and
every architecture through `infinity train` and `infinity export`."""

from __future__ import annotations

import json

import pytest
import torch
from _engine_models import SMALL_LLAMA, max_rel_diff, random_ids
from _hf_models import ARCHS, VOCAB, reference_losses, write_corpus, write_model_dir

from infinity.cli.main import main
from infinity.data import open_dataset
from infinity.models import export_hf, from_pretrained_dir

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
    cfg = transformers.LlamaConfig(**{**SMALL_LLAMA, **HF_VARIANTS[variant]})
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
    ids = random_ids(300, T=33)
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
    ids = random_ids(300, T=29, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cli_trains_and_exports_every_architecture(tmp_path, arch):
    """`infinity train` on a saved directory of each architecture gives the losses and
    gradient norms of PyTorch + AdamW on the same batches (accumulation 2, clipping on);
    `infinity export` writes a directory the same transformers class loads, with the
    logits of the reference model after the same steps."""
    model_dir = write_model_dir(transformers, arch, tmp_path)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 8000},
    }))  # fmt: skip
    save = tmp_path / "run"
    assert main([
        "train", "--model", str(model_dir), "--data", str(corpus), "--save-dir", str(save),
        "--seq-len", "12", "--micro-batch", "2", "--grad-accum", "2", "--seed", "5",
        "--steps", "3", "--config", str(ds), "--no-progress",
    ]) == 0  # fmt: skip
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    data = open_dataset(
        corpus, seq_len=12, seed=5, tokenizer_dir=model_dir, cache_dir=tmp_path / "t"
    )
    batches = [data.next_batch(2) for _ in range(6)]  # the batches the run saw, in order
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    ref, norms, trained = reference_losses(
        ref_model, batches, accum=2, clip=0.5, lr=1e-2, weight_decay=0.01
    )
    assert max_rel_diff([r["loss"] for r in records], ref) < 1e-5
    assert max_rel_diff([r["grad_norm"] for r in records], norms) < 1e-5

    out = tmp_path / "export"
    tok = [str(model_dir / n) for n in ("tokenizer.json", "tokenizer_config.json")]
    assert (
        main(["export", str(save), "--out", str(out), "--dtype", "fp32", "--copy-files", *tok]) == 0
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(trained)
    ids = random_ids(VOCAB, T=12, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(
            back(ids).logits, trained.eval()(ids).logits, rtol=1e-4, atol=1e-4
        )
    assert transformers.AutoTokenizer.from_pretrained(out)("fox").input_ids


@pytest.mark.parametrize(
    "model_type,needles",
    [("vit", ["model_type 'vit'", "AutoModelForCausalLM"]), ("made-up", ["cannot read it"])],
)
def test_cli_refuses_a_model_that_is_not_a_causal_lm(tmp_path, capsys, model_type, needles):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": model_type}))
    corpus = write_corpus(tmp_path / "c.jsonl")
    code = main(["train", "--model", str(model_dir), "--data", str(corpus), "--save-dir",
                 str(tmp_path / "s"), "--byte-tokens", "--no-progress"])  # fmt: skip
    assert code != 0
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    assert "Traceback" not in err


def test_cli_activation_checkpointing_uses_the_models_own(tmp_path, monkeypatch):
    """--activation-checkpointing turns on transformers' own checkpointing: same losses."""
    model_dir = write_model_dir(transformers, "qwen2", tmp_path)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    enabled = []
    cls = transformers.Qwen2ForCausalLM
    original = cls.activation_checkpointing_enable

    def spy(self, *args, **kwargs):
        enabled.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "activation_checkpointing_enable", spy)
    runs = {}
    for flag in ([], ["--activation-checkpointing"]):
        save = tmp_path / f"run{len(flag)}"
        assert main([
            "train", "--model", str(model_dir), "--data", str(corpus), "--save-dir", str(save),
            "--seq-len", "12", "--micro-batch", "2", "--steps", "2", "--seed", "1",
            "--no-progress", *flag,
        ]) == 0  # fmt: skip
        lines = (save / "metrics.jsonl").read_text().splitlines()
        runs[len(flag)] = [json.loads(line)["loss"] for line in lines]
    assert enabled == ["Qwen2ForCausalLM"]
    assert max_rel_diff(runs[1], runs[0]) < 1e-6


def test_cli_without_transformers_says_what_to_install(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    corpus = write_corpus(tmp_path / "c.jsonl")
    code = main(["train", "--model", "tiny", "--data", str(corpus), "--save-dir",
                 str(tmp_path / "s"), "--byte-tokens", "--no-progress"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "infinity-trainer[hf]" in err and "Traceback" not in err


def test_cli_refuses_a_sequence_longer_than_the_models_positions(tmp_path, capsys):
    """GPT-2 states its positions as n_positions: the one check reads the transformers
    config, so they count as a Llama's max_position_embeddings do, before anything starts."""
    model_dir = write_model_dir(transformers, "gpt2", tmp_path)  # learned positions: 64
    corpus = write_corpus(tmp_path / "c.jsonl")
    save = tmp_path / "s"
    code = main(["train", "--model", str(model_dir), "--data", str(corpus), "--save-dir",
                 str(save), "--seq-len", "65", "--no-progress"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "--seq-len 65 is longer than the model's max_position_embeddings (64)" in err
    assert "pass --seq-len 64 or less" in err and "Traceback" not in err
    assert list(save.iterdir()) == []  # no lock, no token cache: nothing was started
