"""benchmarks/telemetry_overhead.py at a tiny size: it counts the engine's ranges in a step and
accounts their cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_telemetry_overhead_tiny(tmp_path):
    out = tmp_path / "t.json"
    args = ["--layers", "2", "--hidden", "64", "--vocab", "256", "--seq", "16", "--steps", "2"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "telemetry_overhead.py"), *args, "--json", out],
        env=dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    ranges = rec["ranges_per_step"]
    assert ranges["infinity::engine::forward"] == ranges["infinity::engine::step"] == 1
    assert ranges["infinity::zero::gather"] >= 2 * 2  # each layer, forward and backward
    assert ranges["infinity::zero::accumulate_grad"] > 0
    assert 0 < rec["range_off_s"] < rec["record_function_s"]
    assert 0 < rec["telemetry_s_per_step"] < rec["median_step_s"]
