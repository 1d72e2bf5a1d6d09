"""`infinity train`'s telemetry end to end: every metrics.jsonl record carries the step's
breakdown and NVMe bytes, the progress bar a compact line, and --profile a Chrome trace."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _train_inputs import train_args, write_inputs

from infinity.cli.main import main
from infinity.engine import Engine
from infinity.utils.telemetry import StepTelemetry, nvme_bytes

PARTS = ("forward_seconds", "backward_seconds", "optimizer_seconds")
COMPACT = re.compile(r"\| fw \d+\.\d+ bw \d+\.\d+ opt \d+\.\d+ io \d+\.\d+")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("telemetry"))


def _args(inputs, save_dir, *extra):
    return train_args(*inputs, save_dir, *extra, lr=None, no_progress=None)


def _records(save_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def counters(monkeypatch):
    """The NVMe byte counters of `memory_stats()` right after each optimizer step."""
    seen: list[tuple[int, int]] = []
    measure = Engine._measure_step

    def spy(self):
        telemetry = measure(self)
        seen.append(nvme_bytes(self.memory_stats()))
        return telemetry

    monkeypatch.setattr(Engine, "_measure_step", spy)
    return seen


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_metrics_carry_each_steps_telemetry(tmp_path, capsys, inputs, counters, tier):
    extra = ["--steps", 3]
    if tier == "nvme":
        (tmp_path / "ssd").mkdir()
        extra += ["--nvme", tmp_path / "ssd", "--placement", "nvme"]
    assert main(_args(inputs, tmp_path / "run", *extra)) == 0
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    fields = set(StepTelemetry.__dataclass_fields__)
    for r, (read, written), prev in zip(records, counters, [(0, 0), *counters], strict=False):
        assert fields <= set(r)
        assert all(r[p] > 0 for p in PARTS)
        assert sum(r[p] for p in PARTS) <= r["step_seconds"] <= r["step_s"]
        assert r["gather_wait_seconds"] <= r["forward_seconds"] + r["backward_seconds"]
        assert r["optimizer_compute_seconds"] <= r["optimizer_seconds"]
        assert r["peak_rss_bytes"] > 1 << 20
        assert r["peak_device_bytes"] == 0  # the CPU device's memory is host RAM
        # On the CPU device a gather aliases a host home; from NVMe it copies the pool buffer.
        assert (r["host_to_device_bytes"] > 0) is (tier == "nvme")
        if tier == "cpu":
            assert (r["nvme_read_bytes"], r["nvme_write_bytes"]) == (0, 0)
            assert r["nvme_optim_wait_seconds"] == r["nvme_param_wait_seconds"] == 0
        elif r["step"] > 1:  # the first has no counters of the step before to compare with
            assert (r["nvme_read_bytes"], r["nvme_write_bytes"]) == (
                read - prev[0],
                written - prev[1],
            )
            assert r["nvme_read_bytes"] > 0 and r["nvme_write_bytes"] > 0
            assert r["nvme_optim_wait_seconds"] <= r["optimizer_seconds"]
            # By tier, summing to the totals: the sweep reads and writes the state (this
            # model's parameters are persistent and its gradients fit their host buffers).
            for way in ("read", "write"):
                tiers = [r[f"nvme_{t}_{way}_bytes"] for t in ("param", "optim", "grad")]
                assert sum(tiers) == r[f"nvme_{way}_bytes"]
                assert r[f"nvme_optim_{way}_bytes"] > 0
    assert len(COMPACT.findall(capsys.readouterr().err)) >= 3  # one per step, in the bar


def test_profile_writes_a_chrome_trace_of_the_steps(tmp_path, capsys, inputs):
    (tmp_path / "ssd").mkdir()
    run = tmp_path / "run"
    args = _args(
        inputs, run, "--steps", 4, "--profile", 2, "--nvme", tmp_path / "ssd", "--placement", "nvme"
    )
    assert main([*args, "--no-progress"]) == 0
    trace = run / "profile" / "trace-steps-2-3.json"
    assert f"--profile: steps 2-3 written to {trace}" in capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    for name in (
        "infinity::engine::forward",
        "infinity::engine::backward",
        "infinity::zero::gather",
        "infinity::zero::prefetch",
        "infinity::zero::adam_sub_group",
        "infinity::swap::optim_wait",
        "infinity::swap::param_wait",
    ):
        assert name in names, name
    assert [p.name for p in (run / "profile").iterdir()] == [trace.name]


def test_profile_longer_than_the_run_is_refused(tmp_path, capsys, inputs):
    assert main(_args(inputs, tmp_path / "run", "--steps", 2, "--profile", 2)) != 0
    err = capsys.readouterr().err
    assert "--profile 2 records 2 steps after 1 warm-up step, but --steps is 2" in err
    assert "--steps 3 or more, or --profile 1" in err and "Traceback" not in err


def test_profile_of_a_resumed_run_fits_the_steps_left(tmp_path, capsys, inputs):
    run = tmp_path / "run"
    assert main([*_args(inputs, run, "--steps", 1), "--no-progress"]) == 0
    capsys.readouterr()
    resumed = _args(inputs, run, "--steps", 2, "--profile", 1, "--resume", "--no-progress")
    assert main(resumed) == 0
    out = capsys.readouterr().out
    assert "--profile 1: the run has 1 step(s) left; profiling 1 after 0 warm-up step(s)" in out
    trace = run / "profile" / "trace-steps-2-2.json"
    assert f"--profile: steps 2-2 written to {trace}" in out
    assert "infinity::zero::gather" in {
        e.get("name") for e in json.loads(trace.read_text())["traceEvents"]
    }


def test_wall_clock_breakdown_in_the_config_logs_each_step(tmp_path, caplog, inputs):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"wall_clock_breakdown": True, "steps_per_print": 1}))
    (tmp_path / "ssd").mkdir()
    args = _args(
        inputs,
        tmp_path / "run",
        "--steps",
        2,
        "--config",
        cfg,
        "--nvme",
        tmp_path / "ssd",
        "--placement",
        "nvme",
    )
    with caplog.at_level("INFO", logger="infinity.engine"):
        assert main([*args, "--no-progress"]) == 0
    lines = [r.getMessage() for r in caplog.records if " time: " in r.getMessage()]
    assert [line.split(" time:")[0] for line in lines] == ["step 1", "step 2"]
    assert all("forward" in line and "nvme wait: params" in line for line in lines)
    assert all(r["synchronized"] for r in _records(tmp_path / "run"))


@pytest.mark.parametrize("value, message", [("0", "0 must be positive"),
                                            ("-1", "-1 must be positive"),
                                            ("two", "'two' is not a whole number")])  # fmt: skip
def test_bad_profile_values_are_refused_by_name(tmp_path, capsys, inputs, value, message):
    with pytest.raises(SystemExit) as exit_:
        main(_args(inputs, tmp_path / "run", "--steps", 3, "--profile", value))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --profile: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
