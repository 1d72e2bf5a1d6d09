"""benchmarks/gpu_smoke.py: a clear refusal without CUDA, and the whole script on the CPU
device (both tiers of the tiny model, losses against plain PyTorch, telemetry beside the
estimate)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.accelerator import cuda_available

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_smoke.py"
AIO = ROOT / "benchmarks" / "results" / "aio_bench_2026-11-22.json"


def _run(*args, timeout=600):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(cuda_available(), reason="this machine has a CUDA device")
def test_without_cuda_it_says_so_and_runs_nothing(tmp_path):
    proc = _run("--nvme", tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("gpu_smoke: no CUDA device") and "--device cpu" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def test_dry_run_on_the_cpu_device(tmp_path):
    out = tmp_path / "smoke.json"
    proc = _run("--device", "cpu", "--nvme", tmp_path, "--bench-aio", AIO, "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    cases = record["cases"]
    assert [c["case"]["nvme"] for c in cases] == [False, True]
    for c in cases:
        assert c["ok"] and c["max_rel_diff"] <= 1e-3 and c["bytes_ok"]
        assert len(c["run"]["losses"]) == len(c["reference"]["losses"]) == 2
        last = c["run"]["records"][-1]
        # The telemetry's NVMe bytes and the estimate's agree exactly on the tiny model.
        assert last["nvme_read_bytes"] == c["estimate"]["nvme_read_bytes_per_step"]
        assert last["nvme_write_bytes"] == c["estimate"]["nvme_write_bytes_per_step"]
        assert (last["nvme_read_bytes"] > 0) == c["case"]["nvme"]
    assert proc.stdout.count("(plain PyTorch on the CPU)") == 2
    assert proc.stdout.count("NVMe read per step") == 2
    assert proc.stdout.count("against the estimate's") == 2 and "FAILED" not in proc.stdout
    assert "every loss matched on cpu" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the work directory is gone


def test_gpu_names_map_to_the_estimates(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its shared module, bench_record
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    smoke = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = smoke  # its dataclasses look their module up
    try:
        spec.loader.exec_module(smoke)
    finally:
        del sys.modules[spec.name]
    assert smoke._gpu_name("NVIDIA H100 80GB HBM3") == "h100"
    assert smoke._gpu_name("NVIDIA H200") == "h200"
    assert smoke._gpu_name("NVIDIA A100-SXM4-40GB") == "a100-40"
    assert smoke._gpu_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert smoke._gpu_name("NVIDIA GeForce RTX 4090") == "4090"
    assert smoke._gpu_name("Tesla T4") is None
