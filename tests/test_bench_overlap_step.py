"""benchmarks/overlap_step_bench.py runs end to end at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overlap_step_bench_tiny(tmp_path):
    out = tmp_path / "r.json"
    args = ["--vocab", "128", "--hidden", "32", "--intermediate", "64", "--layers", "2"]
    args += ["--heads", "4", "--kv-heads", "2", "--seq", "16", "--sub-group-size", "4096"]
    args += ["--rounds", "2", "--path", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overlap_step_bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert rec["bitwise_equal_losses"] == {"cpu": True, "nvme": True}
    assert set(rec["median"]) == {"ram_serial", "ram_overlap", "nvme_serial", "nvme_overlap"}
    assert max(rec["ahead_sub_groups"]["ram_serial"]) == 0
    assert rec["model"]["sub_groups"] > 1
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []  # the swap files are gone
