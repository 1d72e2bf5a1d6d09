"""The first run with nothing but the install: `infinity train --model tiny --nvme DIR`
without --data trains on the sample corpus shipped in the package, on byte tokens, and
`infinity generate SAVE_DIR` reads text as the run did, with no flag repeated."""

from __future__ import annotations

import json
import logging

from infinity.cli.main import main
from infinity.data.sample import SAMPLE_CORPUS


def test_the_sample_corpus_is_package_data_of_public_domain_text():
    text = SAMPLE_CORPUS.read_text(encoding="ascii")
    assert 200_000 < len(text) < 400_000
    assert text.startswith("Genesis 1\n\nIn the beginning God created the heaven and the earth.")
    notice = (SAMPLE_CORPUS.parent / "README.md").read_text()
    assert "public domain" in notice and "bible-kjv-text" in notice


def test_train_without_data_then_generate_from_the_save_dir(tmp_path, caplog, capsys):
    save = tmp_path / "run"
    argv = ["train", "--model", "tiny", "--nvme", str(tmp_path / "ssd"), "--save-dir", str(save)]
    with caplog.at_level(logging.INFO):
        assert main([*argv, "--steps", "3", "--seq-len", "64"]) == 0
    assert "no --data: training on the sample corpus" in caplog.text
    assert "--model tiny has no tokenizer: UTF-8 byte tokens" in caplog.text
    assert (save / "step3").is_dir() and (save / "tokenizer" / "byte_tokens.json").is_file()
    capsys.readouterr()
    assert main(["generate", str(save), "--prompt", "In the", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("In the") and len(out.rstrip("\n")) > len("In the")
    # A resume finds the same data and tokens without the flags either.
    assert main([*argv, "--steps", "4", "--seq-len", "64", "--resume"]) == 0
    assert (save / "step4").is_dir()


def test_a_stage_2_zero_offload_config_trains_with_nvme(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True}
    cfg.write_text(json.dumps({"zero_optimization": zero, "fp16": {"enabled": True}}))
    save = tmp_path / "run"
    argv = ["train", "--model", "tiny", "--nvme", str(tmp_path / "ssd"), "--config", str(cfg)]
    assert main([*argv, "--save-dir", str(save), "--steps", "2", "--seq-len", "64"]) == 0
    assert (save / "step2").is_dir()
    # The parameters stayed resident (none read from NVMe); --nvme held the optimizer state.
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(r["nvme_param_read_bytes"] == 0 for r in steps)
    assert sum(r["nvme_optim_read_bytes"] + r["nvme_optim_write_bytes"] for r in steps) > 0
