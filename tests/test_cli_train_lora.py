"""`infinity train --lora-r` end to end: checkpoints hold only the adapters and their
optimizer state, resume is exact and refuses another base or other adapters, `infinity
export` merges into the base (the logits of peft on transformers) or writes the adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _train_inputs import TINY, train_args, write_inputs

from infinity.checkpoint import load_checkpoint
from infinity.cli.main import main

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("lora"))


def _args(model, data, save_dir, *extra):
    return train_args(model, data, save_dir, *extra, lora_r=4, lora_alpha=8)


def _losses(save_dir):
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def test_checkpoint_holds_only_adapters_and_export_matches_peft(tmp_path, inputs):
    model, data = inputs
    save = tmp_path / "run"
    assert main(_args(model, data, save, "--steps", 3, "--lora-targets", "q_proj,v_proj")) == 0
    ckpt = load_checkpoint(save)
    params = [n for n in ckpt.tensor_names() if n.startswith("param/")]
    layers = TINY["num_hidden_layers"]
    assert len(params) == 2 * 2 * layers and all(".lora_" in n for n in params)
    optim = [n for n in ckpt.tensor_names() if n.startswith("optim/")]
    assert optim and all(".lora_" in n for n in optim)
    assert ckpt.state["base_model"]["source"]["path"] == str(model.resolve())

    assert main(["export", str(save), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert main(["export", str(save), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        want = with_adapter(ids).logits
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(plain(ids).logits, want, atol=1e-4)  # the adapters count


def test_resume_is_exact_and_refuses_other_adapters_or_base(tmp_path, capsys, inputs):
    model, data = inputs
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(_args(model, data, straight, "--steps", 4)) == 0
    assert main(_args(model, data, split, "--steps", 2)) == 0
    assert main([*_args(model, data, split, "--steps", 4), "--resume"]) == 0
    assert _losses(split) == _losses(straight)

    # Other adapters: refused before anything is loaded, naming both sets of flags.
    args = [*_args(model, data, split, "--steps", 6), "--resume"]
    args[args.index("--lora-r") + 1] = "8"
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "--lora-r 4" in err and "--lora-r 8" in err and "another --save-dir" in err

    # Another base: the same shapes, other weights.
    other = tmp_path / "other-base"
    shutil.copytree(model, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(other / "model.safetensors")
    weights = {k: v + 0.01 for k, v in weights.items()}
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    assert main([*_args(other, data, split, "--steps", 6), "--resume"]) == 1
    err = capsys.readouterr().err
    assert "different base model" in err and str(model.resolve()) in err, err
    assert str(other.resolve()) in err
    assert load_checkpoint(split).step == 4  # untouched


def test_lora_flags_are_checked(tmp_path, capsys, inputs):
    model, data = inputs
    args = _args(model, data, tmp_path / "s", "--steps", 1)
    no_r = args[: args.index("--lora-r")] + ["--lora-targets", "q_proj"]
    assert main(no_r) == 1
    assert "--lora-targets need --lora-r" in capsys.readouterr().err
    assert main([*args, "--lora-targets", "qkv"]) == 1
    err = capsys.readouterr().err
    assert "['qkv'] are not linear layers" in err and "q_proj" in err
    with pytest.raises(SystemExit):
        main([*args, "--lora-dropout", "1.5"])
    assert "not in [0, 1)" in capsys.readouterr().err


def test_export_flags_need_a_lora_checkpoint(tmp_path, capsys, inputs):
    model, data = inputs
    save = tmp_path / "full"
    args = _args(model, data, save, "--steps", 1)
    assert main(args[: args.index("--lora-r")]) == 0
    assert main(["export", str(save), "--out", str(tmp_path / "a"), "--adapter"]) == 1
    assert "has no LoRA adapters" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
