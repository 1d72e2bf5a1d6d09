"""benchmarks/hf_load_speed.py runs end to end at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hf_load_speed_tiny(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hf_load_speed.py"), "--preset", "tiny",
         "--dir", str(tmp_path / "ckpt"), "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    assert rec["checkpoint_bytes"] > 0
    assert [r["path"] for r in rec["runs"]] == ["new", "old"]  # both loaders, one round
    for run in rec["runs"]:
        assert run["disk_read_gbps"] > 0 and run["load_gbps"] > 0 and run["warm_load_gbps"] > 0
        assert run["first_touch_gbps"] > 0
    assert set(rec["median_ratio"]) == set(rec["median_warm_ratio"]) == {"new", "old"}
