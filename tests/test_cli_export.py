"""`infinity export`: checkpoint (one or several ranks) -> Hugging Face directory."""

from __future__ import annotations

import json

import pytest
import torch
from _engine_models import SMALL_LLAMA

from infinity.checkpoint import begin_save, save_checkpoint
from infinity.cli.main import main
from infinity.models import LlamaConfig, LlamaForCausalLM, from_pretrained_dir

SMALL = dict(SMALL_LLAMA, tie_word_embeddings=True)


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMALL)
    return cfg, LlamaForCausalLM(cfg).eval()


def _state(cfg, model):
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    return {"model": {"config": cfg.to_hf_dict(), "param_shapes": shapes}}


def test_export_single_rank_checkpoint(tmp_path, capsys):
    cfg, model = _model()
    entries = [(f"param/{n}", p.detach()) for n, p in model.named_parameters()]
    entries.append(("exp_avg/model.norm.weight", torch.zeros(64)))  # ignored by export
    save_checkpoint(tmp_path / "ck", entries, step=5, state=_state(cfg, model))
    out = tmp_path / "hf"
    assert (
        main(
            [
                "export",
                str(tmp_path / "ck"),
                "--out",
                str(out),
                "--dtype",
                "fp32",
                "--max-shard-size",
                "100KB",
            ]
        )
        == 0
    )
    assert "step 5" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 300, (2, 9))
    torch.testing.assert_close(from_pretrained_dir(out)(ids), model(ids), rtol=0, atol=0)


def test_export_joins_rank_slices(tmp_path):
    cfg, model = _model()
    pending = begin_save(tmp_path / "ck", "t")
    for rank in range(3):
        entries = []
        for n, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            size = -(-flat.numel() // 3)
            entries.append((f"param/{n}", flat[rank * size : (rank + 1) * size].clone()))
        pending.write_shard(rank, entries, rng_state=None)
    pending.commit(step=1, state=_state(cfg, model), world_size=3)
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ck" / "t"), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    got = from_pretrained_dir(out, dtype=torch.float32)
    for n, p in model.named_parameters():
        torch.testing.assert_close(dict(got.named_parameters())[n], p.detach().bfloat16().float())


def test_export_errors(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "--resume" not in err
    save_checkpoint(tmp_path / "ck", [("x", torch.ones(1))], step=1)
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "o")]) == 1
    assert "has no model description" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "ck"), "--out", "o", "--max-shard-size", "lots"])
