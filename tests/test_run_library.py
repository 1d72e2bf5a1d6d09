"""The training run as a library (`infinity.run`): what `infinity train` does, driven from
Python through `TrainRun`'s small interface, gives the command's numbers; a run built from
`RunOptions` alone (no flags) trains with its save dir held and its records written; and
one run reads its config file once."""

from __future__ import annotations

import argparse
import errno
import json
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest
from _train_inputs import TRAIN_FLAGS, train_args, write_inputs

from infinity.cli.main import build_parser, main
from infinity.run.inputs import check_inputs
from infinity.run.options import (
    OPTION_CHOICES,
    POSITIVE_OPTIONS,
    RunOptions,
    config_from_args,
    read_config_file,
)
from infinity.run.ranks import join
from infinity.run.savedir import SaveDirClaim
from infinity.run.stop import StopSignals
from infinity.run.training import TrainRun


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lib")
    model, data = write_inputs(root)
    val = root / "val.jsonl"
    val.write_text("".join(json.dumps({"text": f"val {i}: " + "ab" * i}) + "\n" for i in range(5)))
    return model, data, val


def _records(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


def test_setup_step_evaluate_save_close_give_the_commands_numbers(tmp_path, inputs):
    pytest.importorskip("transformers")
    model, data, val = inputs
    flags = ("--steps", 1, "--eval-data", val)
    assert main(train_args(model, data, tmp_path / "cli", *flags)) == 0
    (step,) = [r for r in _records(tmp_path / "cli") if "loss" in r]
    (evaluated,) = [r for r in _records(tmp_path / "cli") if "eval_loss" in r]

    save_dir = tmp_path / "lib"
    args = RunOptions.from_args(
        build_parser().parse_args(train_args(model, data, save_dir, *flags))
    )
    spec = check_inputs(args)
    with join(save_dir, None) as ranks:
        run = TrainRun(args, config_from_args(args, ranks.world_size), ranks, model=spec)
        run.setup()
        try:
            assert run.steps == 1 and run.engine.global_steps == 0
            assert run.step() == step["loss"]  # bit for bit: the same step
            assert run.evaluate().loss == evaluated["eval_loss"]
            tag = run.save()
        finally:
            run.close()
    assert (save_dir / tag).is_dir()
    assert _records(save_dir)[-1]["eval_loss"] == evaluated["eval_loss"]


def test_run_options_are_the_train_flags_with_their_defaults():
    """One field per `infinity train` flag (a new flag the options lack would not reach the
    run), each defaulting as the flag does."""
    args = build_parser().parse_args(["train", "--model", "tiny"])
    flags = set(vars(args)) - {"command", "func", "verbose"}  # the command line's own
    assert {f.name for f in fields(RunOptions)} == flags
    assert RunOptions.from_args(args) == RunOptions(model="tiny")
    with pytest.raises(FrozenInstanceError):
        RunOptions(model="tiny").steps = 3  # type: ignore[misc]


def test_run_options_refuse_what_the_flags_refuse():
    """Built in Python, a value the flag's parser would refuse is refused, naming it; the
    lists checked are the parser's own."""
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    actions = sub.choices["train"]._actions
    assert {a.dest: tuple(a.choices) for a in actions if a.choices} == OPTION_CHOICES
    positive = {a.dest for a in actions if a.type and a.type.__name__.startswith("_positive")}
    assert positive == set(POSITIVE_OPTIONS)
    with pytest.raises(ValueError, match="dtype='fp8'.*'bf16'"):
        RunOptions(model="tiny", dtype="fp8")
    with pytest.raises(ValueError, match="steps=0: must be a positive number"):
        RunOptions(model="tiny", steps=0)
    assert RunOptions(model="tiny", dtype="bf16", steps=1).steps == 1


def test_a_run_built_in_python_trains_with_its_save_dir_held_and_its_records(tmp_path, inputs):
    """No argparse: the options are built directly, the same value the flags give."""
    pytest.importorskip("transformers")
    model, data, val = inputs
    save_dir = tmp_path / "py"
    options = RunOptions(
        model=str(model), data=str(data), save_dir=str(save_dir), steps=2,
        eval_data=str(val), eval_every=1, **TRAIN_FLAGS,
    )  # fmt: skip
    flags = train_args(model, data, save_dir, "--steps", 2, "--eval-data", val, "--eval-every", 1)
    assert RunOptions.from_args(build_parser().parse_args(flags)) == options
    spec = check_inputs(options)
    with join(save_dir, None) as ranks, SaveDirClaim(save_dir) as claim:
        with pytest.raises(OSError) as held:  # the save dir is this run's while it lasts
            SaveDirClaim(save_dir).__enter__()
        assert held.value.errno == errno.EBUSY
        run = TrainRun(options, config_from_args(options, ranks.world_size), ranks,
                       model=spec, claim=claim)  # fmt: skip
        run.setup()
        try:
            with StopSignals() as signals:
                assert run.train(signals) == 0
            assert run.engine.global_steps == 2
        finally:
            run.close()
    records = _records(save_dir)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss"] > 0 for r in steps)
    assert [r["step"] for r in evals] == [1, 2] and evals[-1]["eval_tokens"] > 0
    assert (save_dir / "step2").is_dir()  # the checkpoint after the last step


def test_a_run_reads_its_config_file_once(tmp_path, inputs, monkeypatch):
    """The planner's view of what the user set comes from the one read (it used to read the
    file again, up to three times)."""
    import infinity.config.parse as parse

    model, data, _ = inputs
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    reads: list[str] = []
    real = parse.read_json
    monkeypatch.setattr(parse, "read_json", lambda path: reads.append(path) or real(path))
    flags = dict(nvme=tmp_path / "ssd", placement="auto", config=config, steps=1)
    assert main(train_args(model, data, tmp_path / "run", **flags)) == 0
    assert (tmp_path / "run" / "placement.json").is_file()  # the planner decided
    assert reads == [str(config)]
    written = json.loads(config.read_text())
    assert read_config_file(argparse.Namespace(config=str(config))) == written
    assert read_config_file(argparse.Namespace(config=None)) == {}
