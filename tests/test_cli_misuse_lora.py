"""A new user's mistakes with LoRA, --nvme lists and the Python API, beside
tests/test_cli_misuse.py: each
ends with one clear message (exit 1, a phrase naming the fix, no traceback, the checkpoint
unchanged), or, where the request is sound, it works."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from _hf_models import write_model_dir
from _train_inputs import train_args, write_inputs

import infinity
from infinity.checkpoint import load_checkpoint
from infinity.cli.main import main

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("misuse-lora"))


@pytest.fixture(scope="module")
def lora_run(inputs, tmp_path_factory):
    """A LoRA run of 2 steps on q_proj,v_proj."""
    save = tmp_path_factory.mktemp("lora-run") / "run"
    assert main(_args(inputs, save, "--steps", 2, "--lora-targets", "q_proj,v_proj")) == 0
    return save


def _args(inputs, save_dir, *extra):
    return train_args(*inputs, save_dir, *extra, lora_r=4, lora_alpha=8)


def _digest(save: Path) -> dict[str, str]:
    return {
        str(p.relative_to(save)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(save.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _fails(capsys, argv, phrase) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err, err
    return err


def test_resume_naming_the_same_targets_in_another_order_is_accepted(inputs, lora_run, tmp_path):
    save = tmp_path / "run"
    shutil.copytree(lora_run, save)
    assert (
        main([*_args(inputs, save, "--steps", 3, "--lora-targets", "v_proj,q_proj"), "--resume"])
        == 0
    )
    assert load_checkpoint(save).step == 3


ALL_TARGETS = "v_proj,q_proj,k_proj,o_proj,up_proj,gate_proj,down_proj"


def test_resume_naming_the_default_targets_in_another_order_is_accepted(inputs, tmp_path, capsys):
    """A run on the default targets (every linear layer of the blocks) resumed with those
    layers named, in another order: the same adapters, so it continues; other layers are
    still refused, naming both sets."""
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 2)) == 0
    before = _digest(save)
    fewer = [*_args(inputs, save, "--steps", 3, "--lora-targets", "v_proj,q_proj"), "--resume"]
    _fails(capsys, fewer, "--lora-targets down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj")
    assert _digest(save) == before
    same = [*_args(inputs, save, "--steps", 3, "--lora-targets", ALL_TARGETS), "--resume"]
    assert main(same) == 0
    assert load_checkpoint(save).step == 3


def test_a_lora_rank_larger_than_the_layers_is_refused(inputs, lora_run, capsys):
    before = _digest(lora_run)
    args = [*_args(inputs, lora_run, "--steps", 3), "--resume"]
    args[args.index("--lora-r") + 1] = "1000"
    _fails(capsys, args, "LoRA rank r (--lora-r) 1000 is larger than layer")
    assert _digest(lora_run) == before


def test_gpt2_conv1d_layers_are_named_as_unable_to_take_lora(inputs, tmp_path, capsys):
    gpt2 = write_model_dir(transformers, "gpt2", tmp_path)
    args = train_args(gpt2, inputs[1], tmp_path / "run", "--steps", 1, lora_r=4)
    err = _fails(capsys, args, "Conv1D layers, as in GPT-2, which cannot take LoRA")
    assert "c_attn" in err
    args += ["--lora-targets", "c_attn"]
    _fails(capsys, args, "c_attn are transformers' Conv1D layers")


def test_the_adapter_export_loads_with_auto_peft(lora_run, tmp_path):
    out = tmp_path / "adapter"
    assert main(["export", str(lora_run), "--out", str(out), "--adapter"]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    model = peft.AutoPeftModelForCausalLM.from_pretrained(out)
    assert isinstance(model, peft.PeftModelForCausalLM)


@pytest.mark.parametrize("entries", [2, 3])
def test_an_nvme_list_longer_than_the_processes_is_refused(inputs, tmp_path, capsys, entries):
    dirs = [tmp_path / f"ssd{i}" for i in range(entries)]
    dirs[0].mkdir()  # the others would never be looked at
    args = train_args(
        *inputs,
        tmp_path / "run",
        "--steps",
        1,
        "--nvme",
        ",".join(map(str, dirs)),
        "--placement",
        "nvme",
    )
    _fails(capsys, args, f"--nvme lists {entries} directories")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def _twice():
    model = _model()
    infinity.initialize(model, {})
    infinity.initialize(model, {})


def _trainer_with_optim(optim: str):
    from infinity.integrations.hf import InfinityTrainer

    args = transformers.TrainingArguments(
        output_dir="/nonexistent/out", optim=optim, use_cpu=True, report_to="none"
    )
    return InfinityTrainer(model=_model(), args=args, infinity_config={})


@pytest.mark.parametrize(
    "call, error, phrase",
    [
        (_twice, ValueError, "this model is already under an engine"),
        (
            lambda: _trainer_with_optim("adafactor"),
            ValueError,
            "optim='adafactor' is not an optimizer InfinityTrainer runs: the optimizer step is "
            "the engine's CPU-Adam; use one of 'adamw_torch'",
        ),
        (
            lambda: infinity.initialize(
                _model(), {}, optimizer=torch.optim.SGD(_model().parameters())
            ),
            TypeError,
            "optimizer= is not a parameter here: the optimizer is the engine's own",
        ),
        (
            lambda: infinity.initialize(_model(), {}, lr_scheduler=object()),
            TypeError,
            "config's scheduler section (or call infinity.deepspeed.initialize",
        ),
    ],
    ids=["initialize-twice", "trainer-optim", "initialize-optimizer", "initialize-lr-scheduler"],
)
def test_api_misuse_raises_a_named_error(call, error, phrase):
    with pytest.raises(error, match=re.escape(phrase)):
        call()
