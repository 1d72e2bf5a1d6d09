"""benchmarks/optimizer_swap_bench.py runs end to end at a tiny size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_optimizer_swap_bench_tiny(tmp_path):
    out = tmp_path / "r.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    args = ["--path", str(swap), "--state-gib", "0.001", "--sub-group-numel", "4096"]
    args += ["--rounds", "1", "--backend", "posix", "--buffer-count", "3,5", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "optimizer_swap_bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    groups = round(0.001 * (1 << 30) / (12 * 4096))
    assert rec["sub_groups"] == groups and rec["state_bytes"] == groups * 12 * 4096
    assert [v["buffer_count"] for v in rec["variants"]] == [3, 5]
    for v in rec["variants"]:
        assert v["sweep_gbps"] > 0 and v["fraction_of_raw"] > 0 and len(v["sweep_s"]) == 1
    assert list(swap.iterdir()) == []  # the swap store cleaned up
