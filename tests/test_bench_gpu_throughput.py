"""benchmarks/gpu_throughput.py on the CPU device (its dry run): per-step telemetry from the
real CLI beside the estimate, medians of the steps after the first, and the markdown table."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AIO = ROOT / "benchmarks" / "results" / "aio_bench_2026-11-22.json"


def test_dry_run_on_the_cpu_device(tmp_path):
    out = tmp_path / "throughput.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_throughput", "--device", "cpu", "--cases",
         "tiny-nvme,tiny-lora,tiny-lora-planned", "--steps", "3", "--seq-len", "32",
         "--micro-batch", "1",
         "--nvme", str(tmp_path), "--bench-aio", str(AIO), "--json", str(out),
         "--profile-to", str(tmp_path / "profiles"), "--profile-cases", "tiny-lora"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = json.loads(out.read_text())["cases"]
    assert [c["case"]["lora_r"] for c in cases] == [0, 8, 8]
    for c, profiled in zip(cases, (False, True, False), strict=True):
        # A run is stopped once its last step is recorded (no final checkpoint).
        assert c["rc"] == 0 and not c["timed_out"] and c["stopped"]
        assert len(c["records"]) == 3 + profiled and c["setup_seconds"] > 0
        m, e = c["measured"], c["estimate"]
        # The first step warms up; a profiled second step is left out.
        assert m["steps"] == ([3, 4] if profiled else [2, 3])
        # The engine's NVMe bytes and the estimate's agree exactly on the tiny model; the
        # planner keeps the whole tiny run in RAM, and says so.
        planned = c["case"]["planned"]
        assert m["nvme_read_bytes"] == e["nvme_read_bytes_per_step"]
        assert m["nvme_write_bytes"] == e["nvme_write_bytes_per_step"]
        assert (m["nvme_read_bytes"] > 0) is not planned
        assert (c["plan"] is not None) is planned
        if planned:
            assert (
                c["plan"]["nvme_read_bytes_per_step"] == 0 == e["placement"]["frozen"]["nvme_bytes"]
            )
        assert m["peak_device_bytes"] == 0 and m["peak_rss_bytes"] > 1 << 20
    table = proc.stdout[proc.stdout.index("| case |") :].splitlines()
    assert len(table) == 2 + len(cases) and "tiny LoRA r=8, base on NVMe" in table[-2]
    trace = json.loads(gzip.decompress(Path(cases[1]["profile"]).read_bytes()))
    assert any(ev.get("name") == "infinity::engine::backward" for ev in trace["traceEvents"])
    assert cases[0].get("profile") is None
    # Work and saves are gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, "profiles"])


def test_the_planner_places_the_big_rows_on_the_lent_machine(tmp_path):
    """The 13B LoRA and 7B full rows, as gpu_throughput passes them to `infinity estimate`
    for an H200 machine (125 GiB of RAM, 64 GiB of free disk): the 13B's frozen base stays
    gathered on the GPU (every parameter live, only the adapters cross per step), and the 7B
    fits the RAM budget and the disk."""
    from benchmarks.gpu_throughput import CASES, GPU_CASES, _flags, _parse

    assert GPU_CASES.split(",") == ["1b-ram", "1b-nvme", "13b-lora-resident", "7b-full"]
    args = _parse(["--device", "cuda"])
    plans = {}
    for key in ("13b-lora-resident", "7b-full"):
        flags = _flags(CASES[key], args, tmp_path)
        assert "--placement" not in flags and flags[flags.index("--ram-budget") + 1] == "100G"
        out = tmp_path / f"{key}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "infinity.cli.main", "estimate", *flags, "--device", "h200",
             "--bench-aio", str(AIO), "--json", str(out)],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        plans[key] = json.loads(out.read_text())
    lora = plans["13b-lora-resident"]
    assert lora["placement"]["live_parameters"] == lora["params"] > 13e9
    assert lora["trainable_params"] < 1e8 and lora["host_device_bytes_per_step"] < 1e9
    assert lora["device_bytes"] < 140 * 2**30
    full = plans["7b-full"]
    assert full["trainable_params"] == full["params"] > 6.7e9
    assert full["peak_rss_bytes"] <= 100 * 2**30 and full["nvme_bytes"] <= 64 * 2**30
