"""The batch figures of `infinity estimate` and `infinity train` count every rank."""

from __future__ import annotations

import argparse
import json

import pytest

from infinity.cli.main import build_parser, main
from infinity.config import RunFacts, resolve_run
from infinity.run.options import config_from_args


def _ds(tmp_path, **batch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(batch))
    return path


def test_estimate_counts_the_ranks_in_the_global_batch(tmp_path, capsys):
    cfg = _ds(
        tmp_path,
        train_batch_size=8,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
    )
    base = ["estimate", "--model", "tiny", "--device", "a100", "--seq-len", "16"]
    assert main([*base, "--config", str(cfg)]) == 1  # 8 != 2 x 2 on one rank
    assert "world_size (1)" in capsys.readouterr().err
    out = tmp_path / "est.json"
    assert main([*base, "--config", str(cfg), "--world-size", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "= 64 tokens per rank, x 2 ranks = 128 tokens per optimizer step" in text
    assert "tokens/s per rank" in text
    assert json.loads(out.read_text())["inputs"]["world_size"] == 2


def test_train_checks_the_batch_for_its_world_size(tmp_path):
    cfg = _ds(tmp_path, train_batch_size=12, train_micro_batch_size_per_gpu=3)
    args = build_parser().parse_args(["train", "--model", "m", "--data", "d", "--config", str(cfg)])
    assert isinstance(args, argparse.Namespace)
    assert config_from_args(args, 2).gradient_accumulation_steps == "auto"
    assert (
        resolve_run(config_from_args(args, 2), RunFacts(world_size=2)).gradient_accumulation_steps
        == 2
    )
    with pytest.raises(ValueError, match=r"world_size \(5\)"):
        config_from_args(args, 5)
