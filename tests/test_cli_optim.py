"""`--optim adamw|adamw_8bit` on `infinity train` and `infinity estimate`, and
--convert-optim-state: the flags map onto the optimizer section, a config that says
otherwise is one error naming both, and a run trains and resumes with 8-bit moments."""

from __future__ import annotations

import json

import pytest
from _train_inputs import train_args, write_inputs

from infinity.cli.main import build_parser, main
from infinity.run.options import config_from_args


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("train"))


def test_flags_map_onto_the_optimizer_section():
    parse = build_parser().parse_args
    args = parse(["train", "--model", "tiny", "--data", "x", "--optim", "adamw_8bit",
                  "--convert-optim-state"])  # fmt: skip
    config = config_from_args(args)
    assert config.optimizer.type == "AdamW8bit" and config.optimizer.eight_bit
    assert config.optimizer.convert_state and config.optimizer.adamw_mode
    plain = config_from_args(parse(["train", "--model", "tiny", "--data", "x"]))
    assert not plain.optimizer.eight_bit and not plain.optimizer.convert_state
    with pytest.raises(SystemExit):
        parse(["train", "--model", "tiny", "--data", "x", "--optim", "sgd"])


def test_a_config_that_disagrees_is_one_error(tmp_path, capsys, inputs):
    model, data = inputs
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW8bit"}}))
    flags = ["--config", str(path), "--optim", "adamw"]
    assert main(train_args(model, data, tmp_path / "run", *flags)) == 1
    err = capsys.readouterr().err
    assert "--optim adamw and optimizer.type 'AdamW8bit'" in err and "Traceback" not in err


def test_an_8_bit_run_resumes_and_refuses_32_bit(tmp_path, capsys, inputs):
    model, data = inputs
    save = tmp_path / "run"
    assert main(train_args(model, data, save, "--optim", "adamw_8bit", "--steps", "2")) == 0
    metrics = (save / "metrics.jsonl").read_text()
    assert '"step": 2' in metrics
    resume = ["--resume", "--steps", "3"]
    assert main(train_args(model, data, save, *resume)) == 1
    err = capsys.readouterr().err
    assert "--convert-optim-state" in err and "adamw_8bit" in err and "Traceback" not in err
    assert main(train_args(model, data, save, *resume, "--optim", "adamw_8bit")) == 0
    assert '"step": 3' in (save / "metrics.jsonl").read_text()


def test_the_communication_dtype_is_checked_against_the_precision_the_flags_set(tmp_path):
    """A file's communication_data_type "bf16" is the training dtype under --dtype bf16, and
    refused under the file's own fp32 (`infinity train` refuses it before the data is read)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"communication_data_type": "bf16"}))
    base = ["train", "--model", "tiny", "--data", "x", "--config", str(path)]
    config = config_from_args(build_parser().parse_args([*base, "--dtype", "bf16"]))
    assert config.communication_dtype == "bf16"
    with pytest.raises(ValueError, match=r"'bf16' is not supported when training in fp32"):
        config_from_args(build_parser().parse_args(base))
