"""A new user's mistakes with `infinity train/export/config/bench` and the Python API: each
ends with one clear message (exit 1, or 2 for a malformed command line), never a Python
traceback, a hang or a changed checkpoint.

The table is run in-process (`main(argv)`), which is fast and catches any exception that
would reach the user as a traceback; the few cases that need a real process or real
training are separate tests below.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from _train_inputs import write_inputs

import infinity
from infinity.cli.main import main

pytestmark = pytest.mark.usefixtures("quiet_root_logger")

# -- the inputs: one good set and every kind of broken one, made once --------------------


class World:
    """Paths of the good and broken inputs, by name (W.model, W["bad_json"], ...)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model, self.data = write_inputs(root)
        self.paths: dict[str, Path] = {"model": self.model, "data": self.data}

    def __getitem__(self, name: str) -> str:
        return str(self.paths[name])

    def add(self, name: str, path: Path) -> Path:
        self.paths[name] = path
        return path

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.add(name, self.root / "files" / name)
        path.parent.mkdir(exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return path

    def model_variant(self, name: str, *, config=None, drop=(), files=None) -> Path:
        """A copy of the good model directory with config.json changed or files dropped."""
        path = self.add(name, self.root / "models" / name)
        shutil.copytree(self.model, path)
        if config is not None:
            cfg = json.loads((path / "config.json").read_text())
            cfg.update(config)
            (path / "config.json").write_text(json.dumps(cfg))
        for pattern in drop:
            for p in path.glob(pattern):
                p.unlink()
        for fname, content in (files or {}).items():
            if isinstance(content, bytes):
                (path / fname).write_bytes(content)
            else:
                (path / fname).write_text(content)
        return path

    def config(self, name: str, value) -> Path:
        text = value if isinstance(value, str) else json.dumps(value)
        return self.file(name, text)


def _safetensors_header_only(n: int) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    return struct.pack("<Q", len(header)) + header.encode()


def _build(root: Path) -> World:
    w = World(root)
    docs = [json.dumps({"body": "x" * 40}) for _ in range(10)]
    w.file("no_text_field.jsonl", "\n".join(docs) + "\n")
    w.file("text_not_str.jsonl", '{"text": 42}\n')
    w.file("list_lines.jsonl", '["a", "b"]\n')
    w.file("bad_line.jsonl", '{"text": "fine"}\n{"text": "torn\n')
    w.file("empty.txt", "")
    w.file("blank.jsonl", "\n\n\n")
    w.file("binary.bin", bytes(range(256)) * 64)
    w.file("latin1.txt", "caf\xe9 ".encode("latin-1") * 50)
    w.file("short.txt", "hi")
    w.add("fifo", root / "files" / "fifo")
    os.mkfifo(w.paths["fifo"])
    w.add("dir", root / "files")

    w.config("cfg_invalid.json", '{"train_batch_size": 4,')
    w.config("cfg_list.json", [1, 2])
    w.config("cfg_wrong_type.json", {"fp16": {"enabled": "yes"}})
    w.config("cfg_unknown_key.json", {"train_batchsize": 4})
    w.config("cfg_neg_micro.json", {"train_micro_batch_size_per_gpu": -1})
    w.config("cfg_neg_subgroup.json", {"zero_optimization": {"sub_group_size": -5}})
    w.config("cfg_zero_accum.json", {"gradient_accumulation_steps": 0})
    w.config(
        "cfg_batch_mismatch.json",
        {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3},
    )
    w.config("cfg_fp16_bf16.json", {"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    w.config("cfg_optimizer.json", {"optimizer": {"type": "Lion9"}})
    w.config("cfg_neg_lr.json", {"optimizer": {"type": "AdamW", "params": {"lr": -1}}})
    w.config("cfg_scheduler.json", {"scheduler": {"type": "CosineForever"}})
    w.config("cfg_stage.json", {"zero_optimization": {"stage": 4}})
    w.config("cfg_neg_seed.json", {"seed": -3})
    w.config("cfg_seed_str.json", {"seed": "abc"})
    w.config("cfg_neg_clip.json", {"gradient_clipping": -1.0})
    w.config(
        "cfg_nvme_no_path.json", {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
    )
    w.config("cfg_bad_device.json", {"zero_optimization": {"offload_param": {"device": "tpu"}}})
    w.config("cfg_ok.json", {"zero_optimization": {"stage": 3}})
    w.config("cfg_lr_nan.json", '{"optimizer": {"type": "AdamW", "params": {"lr": NaN}}}')
    w.config("cfg_clip_inf.json", '{"gradient_clipping": Infinity}')
    w.config("cfg_seed_bool.json", {"seed": True})
    w.config("cfg_huge_micro.json", {"train_micro_batch_size_per_gpu": 10**6})
    w.config(
        "cfg_sched_auto.json",
        {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
    )
    w.file("not_json.txt", b"\x89PNG\r\n\x1a\n" + bytes(100))

    w.model_variant("no_config", drop=["config.json"])
    w.model_variant("config_invalid", files={"config.json": "{"})
    w.model_variant("config_list", files={"config.json": "[]"})
    w.model_variant("model_type", config={"model_type": "t5"})
    w.model_variant("neg_hidden", config={"hidden_size": -32})
    w.model_variant("str_layers", config={"num_hidden_layers": "two"})
    w.model_variant("heads", config={"num_attention_heads": 5})
    w.model_variant("zero_vocab", config={"vocab_size": 0})
    w.model_variant("small_vocab", config={"vocab_size": 100})
    w.model_variant("no_weights", drop=["*.safetensors", "*.index.json"])
    w.model_variant("garbage_weights", files={"model.safetensors": b"garbage" * 10})
    w.model_variant("header_only_weights", files={"model.safetensors": _safetensors_header_only(8)})
    w.model_variant("no_tokenizer", drop=["tokenizer.json"])
    w.model_variant("broken_tokenizer", files={"tokenizer.json": '{"version": "1.0", "mod'})
    w.model_variant("short_positions", config={"max_position_embeddings": 8})
    w.model_variant("wrong_shapes", config={"intermediate_size": 48})
    w.model_variant("untied", config={"tie_word_embeddings": False})
    truncated = w.model_variant("truncated_weights")
    for p in truncated.glob("*.safetensors"):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    w.add("model_file", w.paths["data"])  # a file where a directory belongs

    w.add("nvme_missing", root / "nowhere" / "ssd")
    w.add("nvme_file", w.paths["data"])
    w.add("ssd", root / "ssd").mkdir()
    w.config("cfg_optim_in_cpu_neg.json",
             {"zero_optimization": {"offload_optimizer": {"max_in_cpu": -1}}})  # fmt: skip
    w.config("cfg_grads_in_cpu_str.json",
             {"zero_optimization": {"offload_optimizer": {"gradients_in_cpu": "yes"}}})  # fmt: skip
    os.symlink("selfloop", w.add("selfloop", root / "selfloop"))  # a link to itself
    (w.add("writing", root / "writing") / ".tmp.step1").mkdir(parents=True)  # a first save
    for name, section in (("param", "offload_param"), ("optim", "offload_optimizer")):
        w.config(
            f"cfg_{name}_cpu.json",
            {"zero_optimization": {section: {"device": "cpu", "max_in_cpu": 1000}}},
        )
    w.config(
        "cfg_grads_cpu.json",
        {"zero_optimization": {"offload_optimizer": {"gradients_in_cpu": True}}},
    )
    w.add("out", root / "exported")  # never created: every export case fails first
    run = w.add("run", root / "runs" / "done")
    assert main(_train(w, "--save-dir", str(run), "--steps", "2", "--save-every", "1")) == 0
    return w


def _digest(path: Path) -> dict[str, str]:
    """Every file under `path` with a hash of its bytes: a checkpoint changed or not (the
    lock file records its last holder, which is no part of a checkpoint)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return _build(tmp_path_factory.mktemp("misuse"))


def _train(w: World, *extra: str, model: str = "model", data: str = "data") -> list[str]:
    return [
        "train", "--model", w[model], "--data", w[data], "--save-dir", str(w.root / "runs" / "x"),
        "--seq-len", "16", "--steps", "1", "--no-progress", *extra,
    ]  # fmt: skip


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: a malformed command line
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


# (id, argv from the world, exit code, phrase the message must contain)
# fmt: off
CASES = [
    # -- train: the command line
    ("steps-zero", lambda w: _train(w, "--steps", "0"), 2, "must be positive"),
    ("steps-word", lambda w: _train(w, "--steps", "ten"), 2, "'ten' is not a whole number"),
    ("seq-len-zero", lambda w: _train(w, "--seq-len", "0"), 2, "must be positive"),
    ("micro-batch-neg", lambda w: _train(w, "--micro-batch", "-2"), 2, "must be positive"),
    ("grad-accum-float", lambda w: _train(w, "--grad-accum", "1.5"), 2, "not a whole number"),
    ("lr-zero", lambda w: _train(w, "--lr", "0"), 2, "must be a finite number and positive"),
    ("lr-nan", lambda w: _train(w, "--lr", "nan"), 2, "must be a finite number and positive"),
    ("lr-word", lambda w: _train(w, "--lr", "fast"), 2, "'fast' is not a number"),
    ("lr-inf", lambda w: _train(w, "--lr", "inf"), 2, "inf must be a finite number"),
    ("micro-batch-huge", lambda w: _train(w, "--micro-batch", "100000"), 1, "--micro-batch"),
    ("dtype-fp8", lambda w: _train(w, "--dtype", "fp8"), 2, "invalid choice: 'fp8'"),
    ("save-every-zero", lambda w: _train(w, "--save-every", "0"), 2, "must be positive"),
    ("seed-word", lambda w: _train(w, "--seed", "abc"), 2, "invalid int value: 'abc'"),
    ("seed-negative", lambda w: _train(w, "--seed", "-1"), 1, "--seed is -1, out of range"),
    ("seed-huge", lambda w: _train(w, "--seed", str(2**64)), 1, f"--seed is {2**64}, out of"),
    ("no-model", lambda w: ["train", "--data", w["data"]], 2, "--model"),
    ("unknown-flag", lambda w: _train(w, "--epochs", "3"), 2, "unrecognized arguments"),
    ("no-command", lambda w: ["trian"], 2, "invalid choice: 'trian'"),
    # -- train: the model
    ("model-missing", lambda w: _train(w, "--model", str(w.root / "nope")), 1, "not a preset"),
    ("model-unknown-preset", lambda w: _train(w, "--model", "llama-70b"), 1, "not a preset"),
    ("model-is-a-file", lambda w: _train(w, model="model_file"), 1, "no config.json"),
    ("model-no-config", lambda w: _train(w, model="no_config"), 1, "no config.json"),
    ("model-config-invalid", lambda w: _train(w, model="config_invalid"), 1, "not valid JSON"),
    ("model-config-list", lambda w: _train(w, model="config_list"), 1, "config.json"),
    ("model-type-t5", lambda w: _train(w, model="model_type"), 1, "t5"),
    ("model-hidden-neg", lambda w: _train(w, model="neg_hidden"), 1, "hidden_size"),
    ("model-layers-str", lambda w: _train(w, model="str_layers"), 1, "num_hidden_layers"),
    ("model-heads", lambda w: _train(w, model="heads"), 1, "attention heads"),
    ("model-vocab-zero", lambda w: _train(w, model="zero_vocab"), 1, "vocab_size"),
    ("model-vocab-small", lambda w: _train(w, model="small_vocab"), 1, "258 token ids"),
    ("model-no-weights", lambda w: _train(w, model="no_weights"), 1, "safetensors"),
    ("model-garbage-weights", lambda w: _train(w, model="garbage_weights"), 1, "safetensors"),
    ("model-header-only", lambda w: _train(w, model="header_only_weights"), 1, "safetensors"),
    ("model-truncated", lambda w: _train(w, model="truncated_weights"), 1, "safetensors"),
    ("model-wrong-shapes", lambda w: _train(w, model="wrong_shapes"), 1, "48"),
    ("model-missing-tensor", lambda w: _train(w, model="untied"), 1, "lm_head.weight"),
    ("seq-len-too-long", lambda w: _train(w, model="short_positions"),
     1, "--seq-len 16 is longer than the model's max_position_embeddings (8)"),
    # -- train: the tokenizer
    ("no-tokenizer", lambda w: _train(w, model="no_tokenizer"), 1, "--byte-tokens"),
    ("broken-tokenizer", lambda w: _train(w, model="broken_tokenizer"),
     1, "tokenizer.json is not valid JSON"),
    ("preset-no-tokenizer", lambda w: _train(w, "--model", "tiny"), 1, "--tokenizer DIR"),
    ("tokenizer-missing", lambda w: _train(w, "--tokenizer", str(w.root / "nope")),
     1, "no such directory"),
    ("tokenizer-empty-dir", lambda w: _train(w, "--tokenizer", w["dir"]), 1, "holds no tokenizer"),
    ("tokenizer-and-bytes", lambda w: _train(w, "--tokenizer", w["model"], "--byte-tokens"),
     1, "contradict"),
    # -- train: the data
    ("data-missing", lambda w: _train(w, "--data", str(w.root / "none.jsonl")),
     1, "does not exist"),
    ("data-directory", lambda w: _train(w, data="dir"), 1, "is a directory"),
    ("data-fifo", lambda w: _train(w, data="fifo"), 1, "named pipe"),
    ("data-device", lambda w: _train(w, "--data", "/dev/null"), 1, "character device"),
    ("data-empty", lambda w: _train(w, data="empty.txt"), 1, "is empty"),
    ("data-blank", lambda w: _train(w, data="blank.jsonl"), 1, "contains no text"),
    ("data-binary", lambda w: _train(w, data="binary.bin"), 1, "not valid UTF-8"),
    ("data-latin1", lambda w: _train(w, data="latin1.txt"), 1, "iconv"),
    ("data-no-field", lambda w: _train(w, data="no_text_field.jsonl"), 1, "--data-field NAME"),
    ("data-field-wrong", lambda w: _train(w, "--data-field", "body"), 1, "no field 'body'"),
    ("data-field-not-str", lambda w: _train(w, data="text_not_str.jsonl"), 1, "not a string"),
    ("data-list-lines", lambda w: _train(w, data="list_lines.jsonl"), 1, "not an object"),
    ("data-torn-line", lambda w: _train(w, data="bad_line.jsonl"), 1, "line 2"),
    ("data-too-short", lambda w: _train(w, data="short.txt"), 1, "lower --seq-len"),
    # -- train: the config file
    ("config-missing", lambda w: _train(w, "--config", str(w.root / "none.json")),
     1, "does not exist"),
    ("config-directory", lambda w: _train(w, "--config", w["dir"]), 1, "is a directory"),
    ("config-invalid", lambda w: _train(w, "--config", w["cfg_invalid.json"]), 1, "JSON"),
    ("config-binary", lambda w: _train(w, "--config", w["not_json.txt"]), 1, "JSON"),
    ("config-list", lambda w: _train(w, "--config", w["cfg_list.json"]), 1, "object"),
    ("config-wrong-type", lambda w: _train(w, "--config", w["cfg_wrong_type.json"]),
     1, "fp16.enabled"),
    ("config-unknown-key", lambda w: _train(w, "--config", w["cfg_unknown_key.json"]),
     1, "train_batchsize"),
    ("config-neg-micro", lambda w: _train(w, "--config", w["cfg_neg_micro.json"]),
     1, "train_micro_batch_size_per_gpu"),
    ("config-neg-subgroup", lambda w: _train(w, "--config", w["cfg_neg_subgroup.json"]),
     1, "sub_group_size"),
    ("config-zero-accum", lambda w: _train(w, "--config", w["cfg_zero_accum.json"]),
     1, "gradient_accumulation_steps"),
    ("config-batch-mismatch", lambda w: _train(w, "--config", w["cfg_batch_mismatch.json"]),
     1, "train_batch_size (8) is not divisible"),
    ("config-fp16-bf16", lambda w: _train(w, "--config", w["cfg_fp16_bf16.json"]), 1, "bf16"),
    ("config-optimizer", lambda w: _train(w, "--config", w["cfg_optimizer.json"]), 1, "Lion9"),
    ("config-neg-lr", lambda w: _train(w, "--config", w["cfg_neg_lr.json"]), 1, "lr"),
    ("config-scheduler", lambda w: _train(w, "--config", w["cfg_scheduler.json"]),
     1, "CosineForever"),
    ("config-stage-4", lambda w: _train(w, "--config", w["cfg_stage.json"]), 1, "not a ZeRO stage"),
    ("config-neg-seed", lambda w: _train(w, "--config", w["cfg_neg_seed.json"]), 1, "seed"),
    ("config-seed-str", lambda w: _train(w, "--config", w["cfg_seed_str.json"]), 1, "seed"),
    ("config-neg-clip", lambda w: _train(w, "--config", w["cfg_neg_clip.json"]),
     1, "gradient_clipping"),
    ("config-nvme-no-path", lambda w: _train(w, "--config", w["cfg_nvme_no_path.json"]),
     1, "nvme_path"),
    ("config-bad-device", lambda w: _train(w, "--config", w["cfg_bad_device.json"]), 1, "tpu"),
    ("config-lr-nan", lambda w: _train(w, "--config", w["cfg_lr_nan.json"]), 1, "lr"),
    ("config-clip-inf", lambda w: _train(w, "--config", w["cfg_clip_inf.json"]),
     1, "gradient_clipping"),
    ("config-seed-bool", lambda w: _train(w, "--config", w["cfg_seed_bool.json"]), 1, "seed"),
    ("config-huge-micro", lambda w: _train(w, "--config", w["cfg_huge_micro.json"]),
     1, "train_micro_batch_size_per_gpu"),
    # -- train: NVMe and save paths
    ("nvme-missing", lambda w: _train(w, "--nvme", w["nvme_missing"]), 1, "nowhere"),
    ("nvme-is-a-file", lambda w: _train(w, "--nvme", w["nvme_file"]), 1, "not a directory"),
    ("nvme-proc", lambda w: _train(w, "--nvme", "/proc/self"), 1, "/proc/self"),
    # -- train: placement within a RAM budget
    ("ram-budget-not-a-size", lambda w: _train(w, "--nvme", w["ssd"], "--ram-budget", "12X"),
     2, "'12X' is not a size"),
    ("ram-budget-below-floor", lambda w: _train(w, "--nvme", w["ssd"], "--ram-budget", "1M"),
     1, "this run needs with its leanest plan"),
    ("ram-budget-in-ram-too-small", lambda w: _train(w, "--ram-budget", "1M"),
     1, "over the budget of"),
    ("device-memory-above-the-card", lambda w: ["estimate", "--model", "llama-7b",
     "--device", "h100", "--lora-r", "16", "--device-memory", "100G"],
     1, "more than the GPU's 80.0 GiB"),
    ("device-memory-on-cpu-without-nvme", lambda w: _train(w, "--device-memory", "1G"),
     1, "--device-memory: on the CPU device"),
    ("ram-budget-above-machine", lambda w: _train(w, "--nvme", w["ssd"], "--ram-budget", "64T"),
     1, "more than this machine's"),
    ("device-memory-on-cpu", lambda w: _train(w, "--nvme", w["ssd"], "--device-memory", "1G"),
     1, "--device-memory: on the CPU device"),
    ("placement-unknown", lambda w: _train(w, "--nvme", w["ssd"], "--placement", "ram"),
     2, "invalid choice"),
    ("placement-nvme-without-nvme", lambda w: _train(w, "--placement", "nvme"),
     1, "--placement nvme puts every class of tensors on NVMe, but no --nvme DIR"),
    ("estimate-placement-nvme-without-nvme",
     lambda w: ["estimate", "--model", "tiny", "--placement", "nvme"], 1, "no --nvme DIR"),
    ("estimate-device-memory-below-the-run",
     lambda w: ["estimate", "--model", "llama-1b", "--device", "h100", "--device-memory", "1M"],
     1, "a device budget of 1.0 MiB (--device-memory 1M) is below the"),
    ("config-param-in-cpu-on-cpu", lambda w: _train(w, "--config", w["cfg_param_cpu.json"]),
     1, "offload_param.max_in_cpu: keep part of an NVMe tier in RAM"),
    ("config-optim-in-cpu-on-cpu", lambda w: _train(w, "--config", w["cfg_optim_cpu.json"]),
     1, "offload_optimizer.max_in_cpu: keep part of an NVMe tier in RAM"),
    ("config-grads-in-cpu-on-cpu", lambda w: _train(w, "--config", w["cfg_grads_cpu.json"]),
     1, "is 'cpu', which keeps everything in RAM already"),
    ("config-optim-in-cpu-neg", lambda w: _train(w, "--config", w["cfg_optim_in_cpu_neg.json"]),
     1, "max_in_cpu"),
    ("config-grads-in-cpu-str", lambda w: _train(w, "--config", w["cfg_grads_in_cpu_str.json"]),
     1, "gradients_in_cpu"),
    ("save-dir-is-a-file", lambda w: _train(w, "--save-dir", w["data"]), 1, "jsonl is a file"),
    ("save-dir-self-link", lambda w: _train(w, "--save-dir", w["selfloop"]), 1,
     "(it is a symbolic link to selfloop, which leads nowhere)"),
    ("save-dir-proc", lambda w: _train(w, "--save-dir", "/proc/infinity-run"), 1,
     "--save-dir /proc/infinity-run cannot be created"),
    ("resume-other-seq-len",
     lambda w: _train(w, "--save-dir", w["run"], "--resume", "--seq-len", "8", "--steps", "4"),
     1, "--seq-len"),
    ("resume-other-seed",
     lambda w: _train(w, "--save-dir", w["run"], "--resume", "--seed", "99", "--steps", "4"),
     1, "resume with --seed 1234"),
    ("resume-other-data",
     lambda w: _train(w, "--save-dir", w["run"], "--resume", "--data", w["latin1.txt"],
                      "--steps", "4"),
     1, "not valid UTF-8"),
    # -- config
    ("config-cmd-missing", lambda w: ["config", str(w.root / "none.json")], 1, "does not exist"),
    ("config-cmd-invalid", lambda w: ["config", w["cfg_invalid.json"]], 1, "JSON"),
    ("config-cmd-mismatch", lambda w: ["config", w["cfg_batch_mismatch.json"]],
     1, "train_batch_size (8) is not divisible"),
    ("config-cmd-world-zero", lambda w: ["config", w["cfg_ok.json"], "--world-size", "0"],
     2, "must be positive"),
    ("config-cmd-no-path", lambda w: ["config"], 2, "path"),
    ("config-cmd-list", lambda w: ["config", w["cfg_list.json"]], 1, "list"),
    ("config-cmd-binary", lambda w: ["config", w["not_json.txt"]], 1, "not JSON text"),
    ("config-cmd-sched-auto", lambda w: ["config", w["cfg_sched_auto.json"], "--resolve"],
     1, "'auto' needs the run length; pass --total-steps N"),
    ("config-cmd-lr-nan", lambda w: ["config", w["cfg_lr_nan.json"]], 1, "lr"),
    # -- export
    ("export-out-exists", lambda w: ["export", w["run"], "--out", w["dir"]], 1, "exist"),
    ("export-copy-missing",
     lambda w: ["export", w["run"], "--out", w["out"], "--copy-files",
                str(w.root / "tokenizer.json")],
     1, "tokenizer.json does not exist"),
    ("export-copy-dir", lambda w: ["export", w["run"], "--out", w["out"], "--copy-files", w["dir"]],
     1, "files is a directory"),
    ("export-shard-zero",
     lambda w: ["export", w["run"], "--out", w["out"], "--max-shard-size", "0"],
     2, "'0' must be a positive size"),
    ("export-shard-negative",
     lambda w: ["export", w["run"], "--out", w["out"], "--max-shard-size=-5GB"],
     2, "'-5GB' must be a positive size"),
    ("export-shard-nan",
     lambda w: ["export", w["run"], "--out", w["out"], "--max-shard-size", "nanGB"],
     2, "'nanGB' is not a size"),
    ("export-shard-inf",
     lambda w: ["export", w["run"], "--out", w["out"], "--max-shard-size", "infGB"],
     2, "'infGB' is not a size"),
    ("export-out-under-file", lambda w: ["export", w["run"], "--out", w["data"] + "/x"],
     1, "corpus.jsonl is a file, not a directory"),
    ("export-shard-size", lambda w: ["export", w["dir"], "--out", "o", "--max-shard-size", "big"],
     2, "'big' is not a size"),
    ("export-dtype", lambda w: ["export", w["dir"], "--out", "o", "--dtype", "int8"],
     2, "invalid choice"),
    ("export-no-out", lambda w: ["export", w["dir"]], 2, "--out"),
    # -- generate
    ("generate-prompt-past-positions",
     lambda w: ["generate", w["run"], "--tokenizer", w["model"], "--prompt", "x" * 2100],
     1, "takes 2048 positions (max_position_embeddings) for the prompt and the reply together; "
        "shorten the prompt to at most 2047 tokens"),
    ("generate-first-save-in-progress",
     lambda w: ["generate", w["writing"], "--byte-tokens", "--prompt", "x"],
     1, "has no complete checkpoint yet: one is being written"),
    # -- bench
    ("bench-aio-missing", lambda w: ["bench", "aio", "--path", w["nvme_missing"], "--size", "1M"],
     1, "nowhere"),
    ("bench-aio-file", lambda w: ["bench", "aio", "--path", w["data"], "--size", "1M"],
     1, "directory"),
    ("bench-aio-size", lambda w: ["bench", "aio", "--path", w["dir"], "--size", "lots"], 2, "lots"),
    ("bench-aio-size-inf", lambda w: ["bench", "aio", "--path", w["dir"], "--size", "infG"], 2,
     "'infG'"),
    ("bench-aio-block", lambda w: ["bench", "aio", "--path", w["dir"], "--block-size", "3"],
     1, "block"),
    ("bench-aio-zero-size", lambda w: ["bench", "aio", "--path", w["dir"], "--size", "0"],
     2, "'0' must be a positive size"),
    ("bench-aio-depth",
     lambda w: ["bench", "aio", "--path", w["dir"], "--size", "1M", "--queue-depth", "0"],
     1, "queue"),
    ("bench-aio-threads",
     lambda w: ["bench", "aio", "--path", w["dir"], "--size", "1M", "--threads", "-1"],
     1, "thread counts must be >= 1"),
    ("bench-aio-backend",
     lambda w: ["bench", "aio", "--path", w["dir"], "--size", "1M", "--backend", "warp"],
     1, "warp"),
    ("bench-aio-repeats",
     lambda w: ["bench", "aio", "--path", w["dir"], "--size", "1M", "--repeats", "0"],
     1, "repeats"),
    ("bench-adam-repeats", lambda w: ["bench", "adam", "--numel", "1000", "--repeats", "0"],
     1, "repeats"),
    ("bench-adam-numel", lambda w: ["bench", "adam", "--numel", "-5"], 1, "-5"),
    ("bench-unknown", lambda w: ["bench", "gpu"], 2, "invalid choice: 'gpu'"),
]
# fmt: on


@pytest.mark.parametrize("argv_of, code, phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_misuse_ends_with_one_clear_message(world, capsys, argv_of, code, phrase):
    before = _digest(world.paths["run"])
    got, out, err = _run(argv_of(world), capsys)
    assert "Traceback" not in err, err
    assert got == code, (got, out, err)
    assert phrase in err, err
    assert _digest(world.paths["run"]) == before, "a checkpoint changed"
    assert not world.paths["out"].exists()


# -- the Python API -----------------------------------------------------------------------


def _engine():
    torch.manual_seed(0)
    config = infinity.Config.load({"train_micro_batch_size_per_gpu": 2})
    with infinity.init(config):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return infinity.initialize(model, config)


def _loss(engine):
    return engine(torch.randn(2, 8)).pow(2).mean()


def _backward_twice():
    engine = _engine()
    loss = _loss(engine)
    engine.backward(loss)
    engine.backward(loss)


def _closed(then):
    engine = _engine()
    engine.close()
    then(engine)


API_CASES = [
    ("step-before-backward", lambda: _engine().step(), RuntimeError, "no backward() since"),
    ("backward-twice", _backward_twice, RuntimeError, "no forward is waiting for its backward"),
    ("backward-not-scalar", lambda: (e := _engine()).backward(e(torch.randn(2, 8))), ValueError,
     "expected a scalar loss"),
    ("forward-after-close", lambda: _closed(_loss), RuntimeError, "the engine is closed"),
    ("step-after-close", lambda: _closed(lambda e: e.step()), RuntimeError, "engine is closed"),
    ("initialize-not-a-module", lambda: infinity.initialize("model", {}), TypeError,
     "expected the model as a torch.nn.Module, got str"),
    ("initialize-unknown-key", lambda: infinity.initialize(torch.nn.Linear(2, 2),
     {"train_batchsize": 3}), ValueError, "did you mean 'train_batch_size'"),
    ("initialize-wrong-type", lambda: infinity.initialize(torch.nn.Linear(2, 2),
     {"fp16": {"enabled": "yes"}}), TypeError, "fp16.enabled"),
    ("initialize-nothing-to-train", lambda: infinity.initialize(torch.nn.ReLU(), {}), ValueError,
     "no parameter with requires_grad=True"),
    ("load-missing-checkpoint", lambda: _engine().load_checkpoint("/nonexistent/run"),
     FileNotFoundError, "/nonexistent/run: that path does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(
    "call, error, phrase", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES]
)
def test_api_misuse_raises_a_named_error(call, error, phrase):
    with pytest.raises(error, match=re.escape(phrase)):
        call()


# -- cases that need a real run or a real process -------------------------------------------


def test_byte_tokens_only_when_asked_for_and_announced(world, tmp_path, caplog, capsys):
    model = world.paths["no_tokenizer"]
    assert _run(_train(world, "--model", str(model)), capsys)[0] == 1  # not silently
    caplog.set_level(logging.INFO)
    code, _, err = _run(_train(world, "--model", str(model), "--byte-tokens",
                               "--save-dir", str(tmp_path / "run")), capsys)  # fmt: skip
    assert code == 0, err
    assert "tokens: UTF-8 bytes (258 token ids)" in caplog.text
    assert "is not used" not in caplog.text  # that model has no tokenizer to ignore
    code, _, err = _run(_train(world, "--byte-tokens", "--save-dir", str(tmp_path / "own")),
                        capsys)  # fmt: skip
    assert code == 0, err
    assert "the model's own tokenizer (tokenizer.json in" in caplog.text


def test_without_transformers_the_message_says_what_to_install(world, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    code, _, err = _run(_train(world), capsys)
    assert code == 1 and "Traceback" not in err
    assert "pip install 'infinity-trainer[hf]'" in err and "transformers" in err


def test_a_preset_takes_a_tokenizer_directory(world, tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO)
    argv = _train(world, "--model", "tiny", "--tokenizer", world["model"],
                  "--save-dir", str(tmp_path / "run"))  # fmt: skip
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    assert f"from {world['model']} (258 token ids)" in caplog.text


def test_data_field_names_the_text(world, tmp_path, capsys):
    docs = [json.loads(line) for line in world.paths["data"].read_text().splitlines()]
    body = tmp_path / "body.jsonl"
    body.write_text("".join(json.dumps({"body": d["text"], "id": i}) + "\n"
                            for i, d in enumerate(docs)))  # fmt: skip
    runs = []
    for data, extra in ((world["data"], ()), (str(body), ("--data-field", "body"))):
        runs.append(tmp_path / f"run{len(runs)}")
        argv = _train(world, "--data", data, "--save-dir", str(runs[-1]), *extra)
        assert _run(argv, capsys)[0] == 0
    tokens = [next((r / "tokens").glob("*.tokens")).read_bytes() for r in runs]
    assert tokens[0] == tokens[1]  # the same text, read from another field


def test_a_bad_batch_is_refused_before_tokenizing(world, tmp_path, capsys):
    save = tmp_path / "run"
    argv = _train(world, "--config", world["cfg_batch_mismatch.json"], "--save-dir", str(save))
    code, _, err = _run(argv, capsys)
    assert code == 1 and "train_batch_size (8) is not divisible" in err
    assert not (save / "tokens").exists()


def test_nvme_on_tmpfs_trains_and_cleans_up(world, tmp_path, capsys):
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    nvme = Path(tempfile.mkdtemp(dir=shm))
    try:
        argv = _train(
            world, "--nvme", str(nvme), "--placement", "nvme", "--save-dir", str(tmp_path / "run")
        )
        code, _, err = _run(argv, capsys)
        assert code == 0, err
        assert list(nvme.iterdir()) == []  # the swap directory is removed
    finally:
        shutil.rmtree(nvme, ignore_errors=True)


def test_prefetch_warning_only_when_buffers_limit_the_model(world, tmp_path, caplog, capsys):
    """The tiny model fits the default buffers: no warning. With two buffers it does not."""
    caplog.set_level(logging.WARNING)
    nvme = tmp_path / "ssd"
    nvme.mkdir()
    argv = _train(
        world, "--nvme", str(nvme), "--placement", "nvme", "--save-dir", str(tmp_path / "a")
    )
    assert _run(argv, capsys)[0] == 0
    assert "prefetch" not in caplog.text
    few = tmp_path / "few.json"
    few.write_text(json.dumps({"zero_optimization": {"offload_param": {"buffer_count": 2}}}))
    argv = _train(world, "--nvme", str(nvme), "--placement", "nvme", "--config", str(few),
                  "--save-dir", str(tmp_path / "b"))  # fmt: skip
    assert _run(argv, capsys)[0] == 0
    assert "hold less than the prefetch depth" in caplog.text


def test_the_installed_command_prints_one_line(world):
    """The real process: the message on stderr, exit 1, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", *_train(world, data="dir")],
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"infinity: error: data file {world['dir']} is a directory; pass one text or JSONL file "
        "(e.g. corpus.jsonl inside it). Data is read twice (tokenized into a cache keyed by the "
        "file's size and time), so save a stream to a file first"
    ]
