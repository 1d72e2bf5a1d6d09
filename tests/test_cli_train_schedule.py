"""`infinity train`'s schedule flags and --report-to tensorboard: the learning rates a run
uses against transformers' get_scheduler, the event file read back against metrics.jsonl,
and each conflicting or impossible flag as one error that leaves --save-dir as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _train_inputs import train_args, write_inputs
from test_schedules_steps import transformers_lrs

from infinity.cli.main import build_parser, main
from infinity.config import RunFacts, resolve_run
from infinity.run.report import TAGS, tensorboard_values

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("train"))


def _records(save_dir) -> list[dict]:
    return [
        json.loads(line) for line in (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    ]


def _events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_cosine_run_uses_transformers_rates_and_reports_to_tensorboard(tmp_path, inputs):
    pytest.importorskip("tensorboard")
    model, data = inputs
    save = tmp_path / "run"
    steps, warmup, min_lr, lr = 6, 2, 1e-3, 1e-2
    flags = ["--steps", steps, "--lr-schedule", "cosine", "--warmup-steps", warmup]
    flags += ["--min-lr", min_lr, "--weight-decay", 0.1, "--report-to", "tensorboard"]
    assert main(train_args(model, data, save, *flags, lr=lr)) == 0
    records = _records(save)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    want = transformers_lrs("cosine", steps, warmup, min_lr, lr)
    assert [r["lr"] for r in records] == pytest.approx(want, rel=1e-12, abs=1e-18)

    events = _events(save / "tensorboard")
    wanted = ["train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"]
    wanted += ["time/forward_s", "time/backward_s", "time/optimizer_s", "time/nvme_wait_s"]
    for tag in wanted:
        assert tag in events, sorted(events)
    for record in records:
        for tag, value in tensorboard_values(record).items():
            assert (record["step"], pytest.approx(value, rel=1e-6, abs=1e-12)) in events[tag], tag
    assert [s for s, _ in events["train/loss"]] == list(range(1, steps + 1))
    assert [v for _, v in events["train/lr"]] == pytest.approx(want, rel=1e-6, abs=1e-12)

    # The same run drawn by infinity plot: every panel has data from these records.
    pytest.importorskip("matplotlib")
    from infinity.cli.plot import draw

    assert main(["plot", str(save)]) == 0
    assert (save / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    loss, lr_ax, speed, time = draw(records).get_axes()
    assert list(loss.get_lines()[0].get_ydata()) == [r["loss"] for r in records]
    assert list(lr_ax.get_lines()[0].get_ydata()) == [r["lr"] for r in records]
    assert len(speed.get_lines()[0].get_xdata()) == steps
    assert len(time.patches) >= 4 * steps and all(p.get_height() >= 0 for p in time.patches)


def test_an_eval_record_becomes_the_eval_loss_tag(tmp_path):
    """[Note: validation loss] in train_report: the hook an evaluation writes through."""
    pytest.importorskip("tensorboard")
    from infinity.run.report import ReportedMetrics

    log = ReportedMetrics(tmp_path)
    log.append({"step": 1, "loss": 2.5, "lr": 1e-3, "nvme_grad_wait_seconds": 0.25})
    log.append({"step": 2, "eval_loss": 2.0, "eval_perplexity": 7.389})
    log.close()
    events = _events(tmp_path / "tensorboard")
    assert events["eval/loss"] == [(2, 2.0)]
    assert events["eval/perplexity"] == [(2, pytest.approx(7.389))]
    assert events["time/nvme_wait_s"] == [(1, 0.25)]
    assert set(events) <= set(TAGS.values())
    assert [r["step"] for r in log.records()] == [1, 2]


def test_without_tensorboard_the_error_says_what_to_install(tmp_path, monkeypatch):
    import sys

    from infinity.run.report import metrics_log

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    args = build_parser().parse_args(
        ["train", "--model", "m", "--data", "x", "--report-to", "tensorboard"]
    )
    with pytest.raises(ImportError, match=r"pip install 'infinity-trainer\[tb\]'"):
        metrics_log(args, tmp_path)
    plain = build_parser().parse_args(["train", "--model", "m", "--data", "x"])
    assert type(metrics_log(plain, tmp_path)).__name__ == "MetricsLog"  # not needed then


def _tree(save: Path) -> dict:
    return {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("config", "flags", "needles"),
    [
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}},
            ["--lr-schedule", "linear"],
            ["--lr-schedule linear", "scheduler.type 'WarmupLR'"],
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.01}}},
            ["--weight-decay", "0.1"],
            ["--weight-decay 0.1", "optimizer.params.weight_decay 0.01"],
        ),
        (None, ["--warmup-steps", "9", "--steps", "4"], ["--warmup-steps 9", "--steps 4"]),
        (None, ["--min-lr", "1e-4"], ["--min-lr", "--lr-schedule cosine"]),
        (None, ["--lr-schedule", "cosine", "--min-lr", "1"], ["--min-lr 1.0", "above the lr"]),
    ],
)
def test_conflicts_are_one_error_and_leave_the_save_dir(
    tmp_path, capsys, inputs, config, flags, needles
):
    model, data = inputs
    save = tmp_path / "run"
    save.mkdir()
    (save / "notes.txt").write_text("kept")
    extra = list(flags)
    if config is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        extra += ["--config", str(path)]
    before = _tree(save)
    assert main(train_args(model, data, save, *extra)) == 1
    err = capsys.readouterr().err
    assert err.count("infinity: error:") == 1, err
    for needle in needles:
        assert needle in err, err
    after = {p: b for p, b in _tree(save).items() if p.name != ".lock"}
    assert after == before


def test_flags_map_onto_the_config_sections(tmp_path):
    from infinity.run.options import config_from_args

    args = build_parser().parse_args([
        "train", "--model", "tiny", "--data", "x", "--lr", "2e-3", "--lr-schedule", "linear",
        "--warmup-ratio", "0.25", "--min-lr", "1e-4", "--weight-decay", "0.05",
    ])  # fmt: skip
    config = resolve_run(config_from_args(args), RunFacts(total_num_steps=10))
    assert config.scheduler.type == "linear"
    assert config.scheduler.params == {
        "total_num_steps": 10, "warmup_ratio": 0.25, "min_lr": 1e-4
    }  # fmt: skip
    assert config.optimizer.weight_decay == 0.05
    assert config.optimizer.lr == 2e-3
    with pytest.raises(SystemExit):  # one warmup or the other
        build_parser().parse_args([
            "train", "--model", "m", "--data", "x", "--warmup-steps", "2", "--warmup-ratio", "0.1"
        ])  # fmt: skip


def test_a_resumed_run_replaces_the_events_past_its_checkpoint(tmp_path):
    """A stopped run wrote steps 1-4, its checkpoint was at step 2: the resumed run's steps
    3-4 are the ones read back, as metrics.jsonl keeps them."""
    pytest.importorskip("tensorboard")
    from infinity.run.report import ReportedMetrics

    first = ReportedMetrics(tmp_path)
    for step in range(1, 5):
        first.append({"step": step, "loss": float(step)})
    first.close()
    first.truncate_after(2)  # what --resume does to metrics.jsonl
    second = ReportedMetrics(tmp_path)
    for step in (3, 4):
        second.append({"step": step, "loss": 10.0 * step})
    second.close()
    assert _events(tmp_path / "tensorboard")["train/loss"] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)
    ]  # fmt: skip
    assert [r["loss"] for r in second.records()] == [1.0, 2.0, 30.0, 40.0]
