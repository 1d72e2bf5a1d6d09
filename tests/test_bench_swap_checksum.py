"""The swap checksum benchmarks (sweep and step) run end to end at a tiny size."""

from __future__ import annotations

import json


def test_swap_checksum_bench_tiny(tmp_path, run_bench):
    out = tmp_path / "r.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    args = ["--path", str(swap), "--state-gib", "0.001", "--sub-group-numel", "4096"]
    args += ["--rounds", "3", "--backend", "posix", "--buffer-count", "3", "--json", str(out)]
    proc = run_bench("-m", "benchmarks.swap_checksum_bench", *args)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert rec["identical"] is True  # checking changes no result
    assert [v["name"] for v in rec["variants"]] == ["off", "sampled", "full-instruction", "full"]
    for v in rec["variants"]:
        assert len(v["sweep_s"]) == len(v["paired_ratios"]) == 3 and v["sweep_gbps"] > 0
        assert (v["name"] == "off") is ("sum_gbps_one_core" not in v)
    assert rec["variants"][0]["cost"] == 0.0
    assert rec["checksum"] in ("CRC-32C", "CRC-32")
    assert list(swap.iterdir()) == []  # the swap store cleaned up


def test_swap_checksum_step_bench_tiny(tmp_path, run_bench):
    out = tmp_path / "r.json"
    args = ["--path", str(tmp_path), "--model", "tiny", "--steps", "2", "--rounds", "1"]
    proc = run_bench(
        "-m",
        "benchmarks.swap_checksum_step_bench",
        *args,
        "--json",
        str(out),
        timeout=300,
        INFINITY_ACCELERATOR="cpu",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads(out.read_text())
    assert sorted(rec["runs"]) == ["full", "off", "sampled"]
    assert all(len(runs) == 1 and runs[0]["step_seconds"] > 0 for runs in rec["runs"].values())
    assert rec["sampled_step_seconds_cost_vs_sampled"] == 0.0
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # the work directory removed
