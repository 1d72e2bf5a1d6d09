"""Exact resume with the product pieces (models, data, checkpoint, RNG) in a plain-torch
loop: a run SIGKILLed after a checkpoint and resumed ends with the uninterrupted losses."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _train_inputs import TINY

from infinity.models import LlamaConfig, LlamaForCausalLM, export_hf

ROOT = Path(__file__).resolve().parents[1]


def _run(args, expect_kill=False):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_train_child.py"), *map(str, args)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    want = -signal.SIGKILL if expect_kill else 0
    assert proc.returncode == want, proc.stderr


def _losses(save_dir):
    lines = (save_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


@pytest.fixture
def setup(tmp_path):
    cfg = LlamaConfig(**TINY)
    torch.manual_seed(3)
    export_hf(LlamaForCausalLM(cfg).named_parameters(), cfg, tmp_path / "model", dtype="fp32")
    data = tmp_path / "corpus.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"doc {i}: " + "abc" * (i % 7 + 3)}) + "\n" for i in range(60))
    )
    return tmp_path / "model", data


def test_sigkill_then_resume_matches_uninterrupted(tmp_path, setup):
    model_dir, data = setup
    steps, every = 12, 4
    _run([model_dir, data, tmp_path / "ref", steps, every, 0, 0])
    ref = _losses(tmp_path / "ref")
    assert [s for s, _ in ref] == list(range(1, steps + 1))
    kill_at = random.Random(0).randint(every + 1, steps - 1)  # after the first checkpoint
    _run([model_dir, data, tmp_path / "run", steps, every, kill_at, 0], expect_kill=True)
    assert len(_losses(tmp_path / "run")) == kill_at
    _run([model_dir, data, tmp_path / "run", steps, every, 0, 1])
    assert _losses(tmp_path / "run") == ref  # exactly, not approximately
