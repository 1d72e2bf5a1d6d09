"""`infinity train` end to end: a tiny Llama from a local directory, metrics, Ctrl-C, SIGKILL
and resume with exactly the uninterrupted losses, export, and every kind of bad input."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from _train_inputs import TINY, train_args, train_process, write_inputs

from infinity.cli.main import build_parser, main
from infinity.config import RunFacts, resolve_run
from infinity.models import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("train"))


def _run(args, timeout=300):
    proc = train_process(args)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _losses(save_dir):
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--data", "--nvme", "--config", "--steps", "--seq-len",
                 "--micro-batch", "--grad-accum", "--lr", "--save-dir", "--save-every",
                 "--resume", "--seed"):  # fmt: skip
        assert flag in out, flag


def test_sigkill_then_resume_gives_the_uninterrupted_losses(tmp_path, inputs):
    model, data = inputs
    steps, every = 10, 3
    rc, _, err = _run(
        train_args(model, data, tmp_path / "ref", "--steps", steps, "--save-every", every)
    )
    assert rc == 0, err
    ref = _losses(tmp_path / "ref")
    assert [s for s, _ in ref] == list(range(1, steps + 1))
    assert all(r == r for _, r in ref)  # finite, recorded

    run_dir = tmp_path / "run"
    proc = train_process(train_args(model, data, run_dir, "--steps", steps, "--save-every", every))
    deadline = time.monotonic() + 240
    while not (run_dir / "latest").exists():  # a checkpoint exists: now kill at a random time
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(random.Random(1).uniform(0.0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    rc, _, err = _run(
        train_args(model, data, run_dir, "--steps", steps, "--save-every", every, "--resume")
    )
    assert rc == 0, err
    assert _losses(run_dir) == ref  # exactly, not approximately


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, inputs):
    model, data = inputs
    save = tmp_path / "run"
    proc = train_process(train_args(model, data, save, "--steps", 10000))
    deadline = time.monotonic() + 240
    while not (save / "metrics.jsonl").exists() or len(_losses(save)) < 2:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Ctrl-C" in out and "--resume" in out
    tag = (save / "latest").read_text().strip()
    step = json.loads((save / tag / "checkpoint.json").read_text())["step"]
    assert step == _losses(save)[-1][0] >= 2


def test_export_of_a_trained_run_matches_the_engine_logits(tmp_path, inputs):
    transformers = pytest.importorskip("transformers")
    model, data = inputs
    save = tmp_path / "run"
    assert main(train_args(model, data, save, "--steps", 2)) == 0
    assert main(["export", str(save), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    from infinity.checkpoint import load_checkpoint

    tensors = {k.removeprefix("param/"): v for k, v in load_checkpoint(save).tensors()
               if k.startswith("param/")}  # fmt: skip
    ours.load_state_dict(tensors, strict=False)
    ours.tie_weights()
    ids = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


# -- bad input: a clear message, a non-zero exit, existing checkpoints untouched ----------


def _fails(capsys, args, *needles):
    assert main(args) != 0
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


def test_model_dir_without_config_json(tmp_path, capsys, inputs):
    _, data = inputs
    (tmp_path / "empty").mkdir()
    _fails(capsys, train_args(tmp_path / "empty", data, tmp_path / "s"), "config.json")


def test_unknown_model(tmp_path, capsys, inputs):
    _, data = inputs
    _fails(capsys, train_args(tmp_path / "nope", data, tmp_path / "s"), "preset")


def test_empty_and_non_utf8_data(tmp_path, capsys, inputs):
    model, _ = inputs
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    _fails(capsys, train_args(model, empty, tmp_path / "s"), "empty")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello \xff\xfe world\n" * 50)
    _fails(capsys, train_args(model, bad, tmp_path / "s2"), "UTF-8")


def test_resume_without_a_checkpoint(tmp_path, capsys, inputs):
    model, data = inputs
    _fails(capsys, [*train_args(model, data, tmp_path / "s"), "--resume"], "no checkpoint")


def test_corrupted_shard_is_detected_and_checkpoints_untouched(tmp_path, capsys, inputs):
    model, data = inputs
    save = tmp_path / "run"
    assert main(train_args(model, data, save, "--steps", 2, "--save-every", 1)) == 0
    tag = (save / "latest").read_text().strip()
    shard = next((save / tag).glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    before = {
        p: p.read_bytes()
        for p in save.rglob("*")
        if p.is_file() and "tokens" not in p.parts and p.name != ".lock"
    }
    _fails(capsys, [*train_args(model, data, save, "--steps", 4), "--resume"], str(shard.name))
    after = {
        p: p.read_bytes()
        for p in save.rglob("*")
        if p.is_file() and "tokens" not in p.parts and p.name != ".lock"
    }
    assert after == before
    # Truncated: same story.
    shard.write_bytes(bytes(raw[: len(raw) // 3]))
    _fails(capsys, [*train_args(model, data, save, "--steps", 4), "--resume"], str(shard.name))


def test_flags_override_the_config_file(tmp_path):
    from infinity.run.options import config_from_args

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }))  # fmt: skip
    args = build_parser().parse_args([
        "train", "--model", "tiny", "--data", "x", "--config", str(cfg), "--micro-batch", "2",
        "--grad-accum", "4", "--lr", "3e-3", "--nvme", str(tmp_path), "--placement", "nvme",
        "--seed", "9",
    ])  # fmt: skip
    config = resolve_run(config_from_args(args), RunFacts(total_num_steps=10))
    assert config.train_micro_batch_size_per_gpu == 2
    assert config.gradient_accumulation_steps == 4
    assert config.train_batch_size == 8
    assert config.optimizer.lr == 3e-3
    assert config.seed == 9
    zero = config.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.nvme_path) == (
        "nvme",
        str(tmp_path),
    )
    assert zero.offload_param.device == "cpu"  # until the NVMe parameter tier is wired in
    assert zero.sub_group_size == 20_000_000  # buffers that fit in RAM, unless the config says
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": 5000}}))
    assert config_from_args(args).zero_optimization.sub_group_size == 5000


def test_nvme_run_matches_the_ram_run(tmp_path, inputs):
    model, data = inputs
    nvme = tmp_path / "ssd"
    nvme.mkdir()
    assert main(train_args(model, data, tmp_path / "ram", "--steps", 3)) == 0
    assert (
        main(
            train_args(
                model, data, tmp_path / "nv", "--steps", 3, "--nvme", nvme, "--placement", "nvme"
            )
        )
        == 0
    )
    assert _losses(tmp_path / "nv") == _losses(tmp_path / "ram")
    assert not [p for p in nvme.rglob("*") if p.is_file()], "swap files left behind"
