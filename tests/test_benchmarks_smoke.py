"""Each benchmark in benchmarks/ runs end to end at a tiny size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hf_load_rss_tiny(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "hf_load_rss.py"),
            "--preset",
            "tiny",
            "--dtype",
            "bf16",
            "--workdir",
            str(tmp_path / "w"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert rec["model_bytes"] > 2 * rec["num_params"]  # bf16 plus headers
    assert set(rec["results"]) == {"load", "init_load", "export", "checkpoint", "peer_load_file"}
    assert rec["results"]["load"]["tensors"] == rec["results"]["init_load"]["tensors"] == 21
    assert rec["results"]["peer_load_file"]["state_bytes"] == 2 * rec["num_params"]
    assert not (tmp_path / "w").exists()


def test_step_bench_tiny(tmp_path):
    out = tmp_path / "s.json"
    args = ["--vocab", "128", "--hidden", "32", "--intermediate", "64", "--layers", "2"]
    args += ["--heads", "4", "--batch", "2", "--seq", "16", "--warmup", "1", "--rounds", "2"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_bench.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert len(rec["step_s"]["infinity"]) == len(rec["step_s"]["torch"]) == 2
    assert rec["ratio"] > 0
    # Same model, same batches: the two runs train identically.
    for a, b in zip(rec["losses"]["infinity"], rec["losses"]["torch"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
