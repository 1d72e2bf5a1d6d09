"""The honest config keys through the real command line: refused DeepSpeed features are one
line naming the file, the key and why; steps_per_print and wall_clock_breakdown show up in
`infinity train`'s log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _train_inputs import write_inputs

from infinity.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "data,line",
    [
        (
            {"zero_optimization": {"zero_quantized_weights": True}},
            "zero_optimization.zero_quantized_weights: true is not supported by Infinity: "
            "weights are gathered in the training dtype, not quantized (ZeRO++ qwZ); remove it "
            "or set it to false",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"buffer_count": 1}}},
            "zero_optimization.offload_optimizer.buffer_count: 1 is out of range; it must be "
            ">= 3: the NVMe optimizer pipeline holds one sub-group being read ahead",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"fast_init": True}}},
            "zero_optimization.offload_optimizer.fast_init: true is not supported by Infinity",
        ),
    ],
)
def test_infinity_config_refuses_with_one_line(tmp_path, capsys, data, line):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    assert main(["config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"ds.json: {line}" in err


def test_train_logs_progress_and_time_breakdown_as_the_config_says(tmp_path):
    model, data = write_inputs(tmp_path)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"steps_per_print": 2, "wall_clock_breakdown": True}))
    args = [
        "train", "--model", model, "--data", data, "--save-dir", tmp_path / "run",
        "--config", config, "--steps", 4, "--seq-len", 16, "--micro-batch", 2,
        "--grad-accum", 2, "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", *map(str, args)],
        env=dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    progress = [line for line in proc.stderr.splitlines() if "infinity.engine: step" in line]
    assert [line.split(": ", 1)[1].split(":")[0] for line in progress] == [
        "step 2",
        "step 2 time",
        "step 4",
        "step 4 time",
    ]
    assert "forward" in progress[1] and "backward" in progress[1] and "(adam " in progress[1]
