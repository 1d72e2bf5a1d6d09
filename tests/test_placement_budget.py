"""`--ram-budget` as a bound, through the real CLI: the measured peak RSS of `infinity train
--nvme` stays within the budget at several sizes and plans (a split of the optimizer state,
everything in RAM); `--nvme` never refuses a run that fits in RAM; and `infinity estimate`
with the same flags makes the same plan (see [Note: a budget is a bound] in
infinity/estimate/placement.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _train_inputs import write_byte_tokenizer

from infinity.models import LlamaConfig, LlamaForCausalLM, export_hf

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

# name: (hidden size, layers, sub_group_size, --ram-budget, the plan it must make)
CASES = {
    "7M-split": (256, 4, 250_000, "540M", "split"),
    "27M-split": (512, 6, 1_000_000, "780M", "split"),
    "27M-in-ram": (512, 6, None, "1G", "in-ram"),  # refused with --nvme before (1.38 GiB)
}


def _model(root: Path, hidden: int, layers: int) -> Path:
    cfg = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      bos_token_id=256, eos_token_id=257, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    export_hf(LlamaForCausalLM(cfg).named_parameters(), cfg, root, dtype="fp32")
    write_byte_tokenizer(root)
    return root


def _flags(tmp: Path, name: str) -> list[str]:
    hidden, layers, sub_group, budget, _ = CASES[name]
    model = tmp / f"model-{hidden}-{layers}"
    if not model.exists():
        _model(model, hidden, layers)
    ssd = tmp / "ssd"
    ssd.mkdir(exist_ok=True)
    flags = ["--model", str(model), "--seq-len", "64", "--nvme", str(ssd), "--ram-budget", budget]
    if sub_group:
        cfg = tmp / f"sub-group-{sub_group}.json"
        cfg.write_text(json.dumps({"zero_optimization": {"sub_group_size": sub_group}}))
        flags += ["--config", str(cfg)]
    return flags


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m infinity ARGS` in its own process, so its peak RSS is the run's alone."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "infinity", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("budget")
    docs = [{"text": f"doc {i}: " + "the quick brown fox jumps " * (i % 9 + 20)} for i in range(80)]
    (tmp / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return tmp


def _train(tmp: Path, name: str) -> tuple[dict, dict]:
    """The plan (placement.json) and the last metrics record of a 2-step run of case `name`
    (run once per module)."""
    save = tmp / f"run-{name}"
    if not (save / "placement.json").exists():
        done = _cli("train", *_flags(tmp, name), "--data", str(tmp / "corpus.jsonl"),
                    "--save-dir", str(save), "--steps", "2", "--no-progress")  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (save / "metrics.jsonl").open()]
    return json.loads((save / "placement.json").read_text()), records[-1]


@pytest.mark.parametrize("name", list(CASES))
def test_the_peak_rss_stays_within_the_budget(inputs, name):
    plan, last = _train(inputs, name)
    budget = plan["budget"]["ram_bytes"]
    state = plan["state"]
    if CASES[name][4] == "split":
        assert state["ram_bytes"] > 0 and state["nvme_bytes"] > 0
    else:  # everything in RAM, nothing moved over the SSD
        assert state["nvme_bytes"] == 0 and plan["nvme_read_bytes_per_step"] == 0
    peak = last["peak_rss_bytes"]
    assert peak <= budget, f"peak {peak / MIB:.1f} MiB over the budget {budget / MIB:.1f} MiB"
    # The margin covers what the estimate does not count: the run stays within it.
    assert peak <= plan["peak_rss_bytes"] + plan["budget"]["margin_bytes"]


def test_estimate_and_train_make_the_same_plan(inputs):
    """The plan is a function of the flags, not of either process's RSS at the moment."""
    out = inputs / "estimate.json"
    done = _cli("estimate", *_flags(inputs, "7M-split"), "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    estimated = json.loads(out.read_text())["placement"]
    trained, _ = _train(inputs, "7M-split")
    assert estimated == trained
    assert estimated["state"]["nvme_bytes"] > 0  # a split, where an RSS probe could move it
