"""`infinity train` and its --save-dir: saves on non-finite steps, strict metrics.jsonl, a
used directory refused (or --overwrite), --resume without `latest`, one run per directory,
resume mismatches in plain terms, and --keep-last."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from _train_inputs import TINY, train_args, train_process, write_byte_tokenizer, write_inputs

from infinity.checkpoint import latest_tag, list_checkpoints, load_checkpoint
from infinity.cli.main import main
from infinity.models import LlamaConfig, LlamaForCausalLM, export_hf

# fp16 with a loss scale of 2**60: dozens of overflow steps (gradient norm inf/NaN) while it
# settles, as every fp16 run has a few of.
FP16_SETTLING = {"fp16": {"enabled": True, "initial_scale_power": 60}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("savedir"))


def _args(inputs, save_dir, *extra):
    return train_args(*inputs, save_dir, *extra)


def _strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def _metrics(save_dir: Path) -> list[dict]:
    return [_strict(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(save_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in _metrics(save_dir)]


def _snapshot(save_dir: Path) -> dict:
    return {
        p.relative_to(save_dir).as_posix(): p.read_bytes()
        for p in sorted(save_dir.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _fails(capsys, args, *needles) -> str:
    assert main(args) == 1
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert "Traceback" not in err
    return err


def test_help_documents_the_save_dir_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--overwrite", "--keep-last", "--resume"):
        assert flag in out, flag


# -- 1. non-finite numbers ---------------------------------------------------------------


def test_fp16_overflow_steps_save_resume_and_log_strict_json(tmp_path, inputs):
    config = tmp_path / "fp16.json"
    config.write_text(json.dumps(FP16_SETTLING))
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--config", config, "--steps", 2)) == 0
    meta = _strict((save / "step2" / "checkpoint.json").read_text())
    assert meta["state"]["engine"]["grad_norm"] == {"$float": "nan"}
    records = _metrics(save)  # strict: no NaN/Infinity literals
    assert all(r["skipped"] for r in records)
    assert all(r["grad_norm"] is None and r["nonfinite"] == {"grad_norm": "nan"} for r in records)
    ckpt = load_checkpoint(save)
    assert ckpt.state["engine"]["grad_norm"] != ckpt.state["engine"]["grad_norm"]  # NaN again
    assert main([*_args(inputs, save, "--config", config, "--steps", 3), "--resume"]) == 0
    assert [r["step"] for r in _metrics(save)] == [1, 2, 3]


def test_nan_weights_train_and_save(tmp_path, inputs):
    cfg = LlamaConfig(**TINY)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    export_hf(model.named_parameters(), cfg, tmp_path / "nan_model", dtype="fp32")
    write_byte_tokenizer(tmp_path / "nan_model")
    save = tmp_path / "run"
    args = _args((tmp_path / "nan_model", inputs[1]), save, "--steps", 2)
    assert main(args) == 0
    first = _metrics(save)[0]
    assert first["loss"] is None and first["nonfinite"]["loss"] == "nan"
    assert load_checkpoint(save).step == 2


def test_sigterm_while_the_fp16_loss_scale_settles_saves(tmp_path, inputs):
    config = tmp_path / "fp16.json"
    config.write_text(json.dumps(FP16_SETTLING))
    save = tmp_path / "run"
    proc = train_process(_args(inputs, save, "--config", config, "--steps", 500))
    deadline = time.monotonic() + 240
    while not ((save / "metrics.jsonl").exists() and len(_metrics(save)) >= 2):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    last = _metrics(save)[-1]
    assert last["skipped"] and last["grad_norm"] is None  # saved on an overflow step
    assert load_checkpoint(save).step == last["step"]


# -- 2. a used --save-dir ----------------------------------------------------------------


def test_fresh_run_in_a_used_save_dir_is_refused_before_tokenizing(tmp_path, inputs, capsys):
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 2, "--save-every", 1)) == 0
    before = _snapshot(save)
    other = tmp_path / "other.txt"  # would add a token cache if it were tokenized
    other.write_text("some other text " * 200)
    for steps in (2, 4):  # the same final tag as `latest`, and a longer run
        args = _args((inputs[0], other), save, "--steps", steps)
        err = _fails(capsys, args, "step1, step2", "--resume", "--save-dir", "--overwrite")
        assert "leftover" not in err and "tokenized" not in err
        assert _snapshot(save) == before


def test_overwrite_starts_over_cleanly(tmp_path, inputs, capsys):
    ref = tmp_path / "ref"
    assert main(_args(inputs, ref, "--steps", 3)) == 0
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 5, "--save-every", 1)) == 0
    (save / ".tmp.step9").mkdir()  # an interrupted save
    assert main(_args(inputs, save, "--steps", 3, "--overwrite")) == 0
    assert list_checkpoints(save) == ["step3"] and latest_tag(save) == "step3"
    assert not list(save.glob(".tmp.*"))
    assert _losses(save) == _losses(ref)  # metrics.jsonl holds the new run only
    _fails(capsys, [*_args(inputs, save, "--steps", 4), "--resume", "--overwrite"], "give one")


def test_metrics_of_a_run_without_checkpoints_are_kept_aside(tmp_path, inputs):
    save = tmp_path / "run"
    save.mkdir()
    (save / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    assert main(_args(inputs, save, "--steps", 1)) == 0
    assert [r["step"] for r in _metrics(save)] == [1]
    (aside,) = save.glob("metrics.*.jsonl")
    assert aside.read_text().count("\n") == 2


# -- 3. `latest` missing or empty ---------------------------------------------------------


@pytest.mark.parametrize("damage", ["missing", "empty", "dangling"])
def test_resume_without_latest_takes_the_newest_verified_checkpoint(
    tmp_path, inputs, capsys, damage
):
    ref = tmp_path / "ref"
    assert main(_args(inputs, ref, "--steps", 4)) == 0
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 3, "--save-every", 1)) == 0
    if damage == "missing":
        (save / "latest").unlink()
    elif damage == "empty":
        (save / "latest").write_text("")
    else:
        (save / "latest").write_text("step7\n")
    # export agrees with --resume
    assert main(["export", str(save), "--out", str(tmp_path / "hf")]) == 0
    assert "step3" in capsys.readouterr().out
    assert main([*_args(inputs, save, "--steps", 4), "--resume"]) == 0
    assert _losses(save) == _losses(ref)
    assert latest_tag(save) == "step4"


def test_resume_skips_a_damaged_newest_checkpoint_without_touching_it(tmp_path, inputs, capsys):
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 3, "--save-every", 1)) == 0
    (save / "latest").unlink()
    shard = save / "step3" / "rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    before = _snapshot(save)
    # step2 verifies, but resuming from it would replace the damaged step3 at step 3
    err = _fails(capsys, [*_args(inputs, save, "--steps", 4), "--resume"], "step3", "move")
    assert "without --resume" not in err and "drop --resume" not in err
    assert _snapshot(save) == before
    (tmp_path / "kept").mkdir()
    (save / "step3").rename(tmp_path / "kept" / "step3")
    assert main([*_args(inputs, save, "--steps", 4), "--resume"]) == 0
    assert [r["step"] for r in _metrics(save)] == [1, 2, 3, 4]
    assert list_checkpoints(save) == ["step1", "step2", "step4"]


def test_damaged_latest_is_refused_with_a_safe_fix(tmp_path, inputs, capsys):
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 2, "--save-every", 1)) == 0
    shard = save / "step2" / "rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    before = _snapshot(save)
    err = _fails(capsys, [*_args(inputs, save, "--steps", 4), "--resume"], "truncated", "move")
    assert "without --resume" not in err and "drop --resume" not in err
    assert _snapshot(save) == before


# -- 4. one run per --save-dir ------------------------------------------------------------


def test_a_second_run_on_the_same_save_dir_is_refused(tmp_path, inputs):
    save = tmp_path / "run"
    first = train_process(_args(inputs, save, "--steps", 100_000))
    try:
        deadline = time.monotonic() + 240
        while not (save / "metrics.jsonl").exists():
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = train_process(_args(inputs, save, "--steps", 2))  # the same command, or --resume
        _, err = second.communicate(timeout=240)
        assert second.returncode == 1, err
        assert f"process {first.pid}" in err and "--steps 100000" in err, err
        assert "Traceback" not in err
    finally:
        first.kill()  # SIGKILL: the lock file stays behind, the lock does not
        first.communicate(timeout=60)
    assert (save / ".lock").exists() and not list_checkpoints(save)
    assert main(_args(inputs, save, "--steps", 1)) == 0


# -- 5. resume mismatches -----------------------------------------------------------------


def test_resume_mismatches_are_named_in_user_terms(tmp_path, inputs, capsys):
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 2)) == 0
    before = _snapshot(save)
    resume = [*_args(inputs, save, "--steps", 3), "--resume"]
    err = _fails(capsys, [*resume, "--dtype", "fp16"], "fp32", "fp16", "--dtype fp32")
    assert "NoScaler" not in err
    _fails(capsys, [*resume, "--micro-batch", "1"], "--micro-batch 2 --grad-accum 2", "is 4")
    _fails(capsys, [*resume, "--seq-len", "32"], "--seq-len 16")
    _fails(capsys, [*resume, "--seed", "6"], "--seed 5")
    untied = LlamaConfig(**{**TINY, "tie_word_embeddings": False})
    export_hf(LlamaForCausalLM(untied).named_parameters(), untied, tmp_path / "untied")
    write_byte_tokenizer(tmp_path / "untied")
    args = [*_args((tmp_path / "untied", inputs[1]), save, "--steps", 3), "--resume"]
    err = _fails(capsys, args, "lm_head.weight", "tie_word_embeddings: True -> False")
    assert "slots" not in err
    assert _snapshot(save) == before


def test_resume_with_the_same_sequences_per_step_split_differently(tmp_path, inputs, caplog):
    ref = tmp_path / "ref"
    assert main(_args(inputs, ref, "--steps", 4)) == 0
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 2)) == 0
    resume = [*_args(inputs, save, "--steps", 4), "--resume", "--micro-batch", "4"]
    assert main([*resume, "--grad-accum", "1"]) == 0
    assert "the same 4 sequences per optimizer step" in caplog.text
    got, want = _losses(save), _losses(ref)
    assert [s for s, _ in got] == [s for s, _ in want]
    torch.testing.assert_close([v for _, v in got], [v for _, v in want], rtol=1e-5, atol=1e-6)


# -- 6. retention ------------------------------------------------------------------------


def test_keep_last_removes_older_checkpoints_after_each_save(tmp_path, inputs):
    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 5, "--save-every", 1, "--keep-last", 2)) == 0
    assert list_checkpoints(save) == ["step4", "step5"] and latest_tag(save) == "step5"
    assert not list(save.glob(".tmp.*"))
    args = [*_args(inputs, save, "--steps", 7, "--save-every", 1, "--keep-last", 1), "--resume"]
    assert main(args) == 0
    assert list_checkpoints(save) == ["step7"] and load_checkpoint(save).step == 7
    # the default keeps everything
    assert main([*_args(inputs, save, "--steps", 9, "--save-every", 1), "--resume"]) == 0
    assert list_checkpoints(save) == ["step7", "step8", "step9"]


def test_a_stop_right_after_resuming_keeps_the_resumed_checkpoint(
    tmp_path, inputs, monkeypatch, capsys
):
    from infinity.run.stop import StopSignals

    save = tmp_path / "run"
    assert main(_args(inputs, save, "--steps", 2)) == 0
    before = _snapshot(save)
    start_training = StopSignals.start_training

    def signal_at_once(self):  # SIGTERM lands before the first step of the resumed run
        start_training(self)
        self.requested = signal.SIGTERM

    monkeypatch.setattr(StopSignals, "start_training", signal_at_once)
    assert main([*_args(inputs, save, "--steps", 4), "--resume"]) == 0
    assert f"stopped by SIGTERM at step 2; checkpoint {save / 'step2'}" in capsys.readouterr().out
    assert _snapshot(save) == before


def test_save_dir_that_is_a_file(tmp_path, inputs, capsys):
    (tmp_path / "f").write_text("x")
    _fails(capsys, _args(inputs, tmp_path / "f", "--steps", 1), "is a file, not a directory")


def test_a_run_whose_save_dir_is_removed_stops_and_never_shares_it(tmp_path, inputs):
    """rm -rf of a live run's --save-dir drops its lock with the directory: the run stops at
    its next step with an error naming that, instead of making the directory again and
    writing into it beside (or over) a second run started there."""
    save = tmp_path / "run"
    first = train_process(_args(inputs, save, "--steps", 100_000, "--save-every", 2))
    try:
        deadline = time.monotonic() + 240
        while not (save / "latest").exists():
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _rm_rf(save)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 1, err
    # Which the run sees depends on where the removal was at its check: the lock file gone
    # first, or the whole directory (made again, or not).
    named = (f"--save-dir {save} was removed", f"--save-dir {save} lost its lock file")
    assert any(n in err for n in named) and "Traceback" not in err, err
    # A save or record already past its check may make the directory again in the moment
    # the removal takes; the run stops at its next check, leaving no checkpoint there.
    assert not save.exists() or list_checkpoints(save) == []
    assert main(_args(inputs, save, "--steps", 2)) == 0  # a second run there is its own
    assert [r["step"] for r in _metrics(save)] == [1, 2] and list_checkpoints(save) == ["step2"]


def _rm_rf(path):
    """`rm -rf` of a directory a live run writes into: repeated, as a user would, while files
    appear in it during the removal."""
    for _ in range(50):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:  # a file was made in it meanwhile: remove again
            if exc.errno != errno.ENOTEMPTY:
                raise
    raise AssertionError(f"{path} kept filling while it was removed")


def test_a_save_dir_made_again_under_a_run_is_named(tmp_path):
    from infinity.run.savedir import SaveDirClaim

    save = tmp_path / "run"
    with SaveDirClaim(save) as claim:
        claim.check()
        (save / ".lock").unlink()
        with pytest.raises(OSError, match="lost its lock file .lock"):
            claim.check()
        shutil.rmtree(save)
        save.mkdir()
        (save / ".lock").touch()  # a second run's
        with pytest.raises(OSError, match="was removed and made again"):
            claim.check()


def test_a_save_dir_replaced_by_a_link_to_itself_is_named(tmp_path, inputs):
    """The live run's directory moved away and a symbolic link of its name made pointing at
    itself: the run stops at its next check naming the loop, not another process."""
    save = tmp_path / "run"
    run = train_process(_args(inputs, save, "--steps", 100_000, "--save-every", 2))
    try:
        deadline = time.monotonic() + 240
        while not (save / "latest").exists():
            assert run.poll() is None, run.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        save.rename(tmp_path / "moved")
        save.symlink_to(save.name)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 1, err
    assert f"--save-dir {save} was replaced by a symbolic link that leads back to itself" in err
    assert "Traceback" not in err and "in use by" not in err, err
    assert list_checkpoints(tmp_path / "moved")  # what it saved is where it was moved to
