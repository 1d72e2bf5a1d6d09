"""Smoke test: the overflow-check benchmark runs at a tiny size and writes its records."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_overflow_check_bench_tiny():
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/overflow_check_bench.py",
            "--numel",
            "1000",
            "--tensors",
            "3",
            "--repeats",
            "1",
            "--warmup",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {(r["dtype"], r["method"]) for r in records} == {
        (d, m)
        for d in ("float32", "float16", "bfloat16")
        for m in ("has_overflow", "sum_per_tensor", "isfinite_all", "aminmax", "foreach_norm")
    }
    assert all(r["median_s"] > 0 and r["numel"] == 999 for r in records)
