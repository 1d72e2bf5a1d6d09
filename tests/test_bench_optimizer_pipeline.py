"""benchmarks/optimizer_pipeline_bench.py runs end to end at a tiny size."""

from __future__ import annotations

import json


def test_optimizer_pipeline_bench_tiny(tmp_path, run_bench):
    out = tmp_path / "r.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    args = ["--path", str(swap), "--state-gib", "0.001", "--sub-group-numel", "4096"]
    args += ["--rounds", "2", "--backend", "posix", "--buffer-count", "3", "--json", str(out)]
    proc = run_bench("-m", "benchmarks.optimizer_pipeline_bench", *args)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert rec["identical"] is True
    settings = [(v["pipeline_read"], v["pipeline_write"]) for v in rec["variants"]]
    assert settings == [(True, True), (True, False), (False, True), (False, False)]
    for v in rec["variants"]:
        assert len(v["sweep_s"]) == 2 and v["sweep_gbps"] > 0
    assert rec["variants"][0]["time_vs_both_on"] == 1.0
    assert list(swap.iterdir()) == []  # the swap store cleaned up
