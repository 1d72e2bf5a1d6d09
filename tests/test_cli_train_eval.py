"""`infinity train --eval-data FILE [--eval-every N]`: the validation loss against the one
computed by hand on the exported model (RAM and NVMe tiers), where the evaluations fall, a
resumed run keeping the schedule, training left as it was without them, and bad validation
input refused before training starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_inputs import train_args, write_inputs

from infinity.cli.main import main
from infinity.data import PackedDataset, build_token_cache, load_tokenizer
from infinity.data.sequential import sequential_batches
from infinity.run.step import causal_lm_loss

SEQ_LEN = 16  # train_args' --seq-len


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model, data = write_inputs(root)
    val = root / "val.jsonl"
    # 7 documents of unequal length: 118 labels, 7 full sequences and a tail of 6 tokens.
    docs = [{"text": f"val {i}: " + "xyz" * i} for i in range(7)]
    val.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return model, data, val


def _records(save_dir) -> list[dict]:
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _evals(save_dir) -> list[dict]:
    return [r for r in _records(save_dir) if "eval_loss" in r]


def _steps(save_dir) -> list[dict]:
    return [r for r in _records(save_dir) if "loss" in r]


def _by_hand(export_dir: Path, tokens: np.ndarray) -> float:
    """The token-weighted mean of causal_lm_loss over every label of `tokens`, cut into
    pieces of SEQ_LEN inputs (the last one shorter), on the exported model in transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export_dir, torch_dtype=torch.float32).eval()
    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, SEQ_LEN):
            piece = ids[start : start + SEQ_LEN + 1][None]  # (1, <= L+1)
            loss = causal_lm_loss(model(input_ids=piece[:, :-1]).logits, piece[:, 1:])
            total += float(loss) * (piece.shape[1] - 1)
            count += piece.shape[1] - 1
    assert count == len(ids) - 1
    return total / count


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_eval_loss_matches_the_exported_model(tmp_path, inputs, tier, caplog):
    pytest.importorskip("transformers")
    model, data, val = inputs
    save = tmp_path / "run"
    extra = ["--nvme", tmp_path / "ssd", "--placement", "nvme"] if tier == "nvme" else []
    caplog.set_level("INFO", logger="infinity.run.training")
    assert main(train_args(model, data, save, "--steps", 3, "--eval-data", val, *extra)) == 0
    (last,) = _evals(save)  # only after the last step without --eval-every
    assert last["step"] == 3
    assert main(["export", str(save), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0

    tokens = build_token_cache(val, load_tokenizer(model), cache_dir=tmp_path / "cache")
    assert last["eval_tokens"] == len(tokens) - 1 == 118
    assert last["eval_loss"] == pytest.approx(_by_hand(tmp_path / "hf", tokens), abs=1e-5)
    assert last["eval_perplexity"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-12)
    assert f"eval at step 3: loss {last['eval_loss']:.4f}" in caplog.text


def test_eval_every_places_evaluations_and_leaves_training_as_it_was(tmp_path, inputs):
    model, data, val = inputs
    flags = ["--steps", 5, "--nvme", tmp_path / "ssd", "--placement", "nvme"]
    assert main(train_args(model, data, tmp_path / "plain", *flags)) == 0
    with_eval = ["--eval-data", val, "--eval-every", 2]
    assert main(train_args(model, data, tmp_path / "eval", *flags, *with_eval)) == 0
    assert [r["step"] for r in _evals(tmp_path / "eval")] == [2, 4, 5]  # and after the last
    records = _records(tmp_path / "eval")
    assert [r["step"] for r in records] == [1, 2, 2, 3, 4, 4, 5, 5]  # each after its step
    # No gradients, no optimizer traffic: the steps compute and move the same as without.
    same = ("loss", "grad_norm", "lr", "nvme_read_bytes", "nvme_write_bytes")
    plain = [{k: r[k] for k in same} for r in _steps(tmp_path / "plain")]
    assert [{k: r[k] for k in same} for r in _steps(tmp_path / "eval")] == plain
    losses = [r["eval_loss"] for r in _evals(tmp_path / "eval")]
    assert len(set(losses)) == 3 and all(math.isfinite(x) for x in losses)


def test_resume_continues_the_eval_schedule(tmp_path, inputs):
    model, data, val = inputs
    flags = ["--eval-data", val, "--eval-every", 2]
    whole = tmp_path / "whole"
    assert main(train_args(model, data, whole, "--steps", 6, *flags)) == 0
    part = tmp_path / "part"
    assert main(train_args(model, data, part, "--steps", 3, *flags)) == 0
    assert [r["step"] for r in _evals(part)] == [2, 3]
    assert main(train_args(model, data, part, "--steps", 6, "--resume", *flags)) == 0
    assert [r["step"] for r in _evals(part)] == [2, 3, 4, 6]  # the next multiple of 2, not 5
    want = {r["step"]: r["eval_loss"] for r in _evals(whole)}
    got = {r["step"]: r["eval_loss"] for r in _evals(part)}
    assert [got[s] for s in (2, 4, 6)] == pytest.approx([want[s] for s in (2, 4, 6)], abs=1e-6)


def test_eval_records_reach_tensorboard(tmp_path, inputs):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, data, val = inputs
    save = tmp_path / "run"
    flags = ["--steps", 2, "--eval-data", val, "--eval-every", 1, "--report-to", "tensorboard"]
    assert main(train_args(model, data, save, *flags)) == 0
    acc = EventAccumulator(str(save / "tensorboard"))
    acc.Reload()
    evals = _evals(save)
    got = [(e.step, e.value) for e in acc.Scalars("eval/loss")]
    assert got == [(r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in evals]
    assert [e.step for e in acc.Scalars("eval/perplexity")] == [1, 2]


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("empty", "is empty"),
        ("short", "fewer than one sequence needs"),
        ("no_eval_data", "--eval-every 2 needs --eval-data"),
    ],
)
def test_bad_eval_data_fails_before_training(tmp_path, inputs, capsys, case, message):
    model, data, _ = inputs
    bad = tmp_path / "val.jsonl"
    if case == "empty":
        bad.write_text("")
    elif case == "short":
        bad.write_text(json.dumps({"text": "tiny"}) + "\n")  # 5 tokens: no sequence of 16
    flags = ["--eval-every", 2] if case == "no_eval_data" else ["--eval-data", bad]
    save = tmp_path / "run"
    assert main(train_args(model, data, save, "--steps", 2, *flags)) == 1
    err = capsys.readouterr().err
    assert message in err
    assert case == "no_eval_data" or f"--eval-data {bad}" in err
    # Nothing trained: no step record, no checkpoint; at most the token caches were written.
    left = sorted(p.name for p in save.glob("[!.]*")) if save.exists() else []  # not .lock
    assert left == (["tokens"] if case == "short" else []), left


@pytest.mark.parametrize("num_tokens", [17, 18, 40, 49, 50])
def test_sequential_batches_visit_every_label_once_in_order(num_tokens):
    tokens = np.arange(num_tokens, dtype=np.uint16)
    data = PackedDataset(tokens, seq_len=SEQ_LEN, seed=0)
    batches = list(sequential_batches(data, 2))
    inputs = torch.cat([x.flatten() for x, _, _ in batches]).tolist()
    labels = torch.cat([y.flatten() for _, y, _ in batches]).tolist()
    assert labels == list(range(1, num_tokens))  # file order, each once
    assert inputs == list(range(num_tokens - 1))
    assert all(x.shape == y.shape and p is None for x, y, p in batches)  # text: no positions
    assert all(x.shape[1] == SEQ_LEN for x, _, _ in batches[: data.num_sequences // 2])


def test_two_ranks_evaluate_as_one(inputs, tmp_path):
    """Under torchrun every rank runs the same evaluation forwards (they gather the
    parameters together); rank 0 writes the same losses one rank gives."""
    from test_cli_train_ranks import _finish, _torchrun

    model, data, val = inputs
    flags = ["--steps", 3, "--eval-data", val, "--eval-every", 2]
    one = tmp_path / "one"
    assert main(train_args(model, data, one, *flags)) == 0
    two = tmp_path / "two"
    args = train_args(model, data, two, *flags, micro_batch=1, no_progress=None)
    code, out = _finish(_torchrun(args, tmp_path / "logs"))
    assert code == 0, out
    want = [(r["step"], r["eval_tokens"]) for r in _evals(one)]
    assert [(r["step"], r["eval_tokens"]) for r in _evals(two)] == want == [(2, 118), (3, 118)]
    got = [r["eval_loss"] for r in _evals(two)]
    assert got == pytest.approx([r["eval_loss"] for r in _evals(one)], abs=1e-5)


def test_progress_bar_shows_the_latest_eval_loss(tmp_path, inputs, capsys):
    model, data, val = inputs
    save = tmp_path / "run"
    flags = ["--steps", 2, "--eval-data", val, "--eval-every", 1]
    assert main(train_args(model, data, save, *flags, no_progress=None)) == 0
    bar = capsys.readouterr().err
    assert f"eval_loss={_evals(save)[-1]['eval_loss']:.4f}" in bar
