"""`infinity config FILE`."""

from __future__ import annotations

import json

from infinity.cli.main import main


def test_prints_the_config_with_deepspeed_keys(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"prefetch_bucket_size": 1e6}}))
    assert main(["config", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["zero_optimization"]["stage3_prefetch_bucket_size"] == 1_000_000
    assert out["train_batch_size"] == "auto"


def test_resolve(tmp_path, capsys):
    path = tmp_path / "ds.json"
    data = {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage3_param_persistence_threshold": "auto"},
    }
    path.write_text(json.dumps(data))
    assert main(["config", str(path), "--resolve", "--world-size", "2", "--hidden-size", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["train_micro_batch_size_per_gpu"] == 4
    assert out["zero_optimization"]["stage3_param_persistence_threshold"] == 640


def test_errors_name_file_and_key(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": "yes"}}))
    assert main(["config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "ds.json: fp16.enabled: expected true or false or 'auto', got 'yes'" in err
    assert main(["config", str(tmp_path / "missing.json")]) == 1
    assert "missing.json' does not exist" in capsys.readouterr().err


def test_a_communication_dtype_the_precision_refuses_is_one_error(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "communication_data_type": "FP16"}))
    assert main(["config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "ds.json: communication_data_type: 'fp16' is not supported when training in bf16" in err
    assert "Traceback" not in err
