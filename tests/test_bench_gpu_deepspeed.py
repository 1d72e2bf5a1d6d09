"""benchmarks/gpu_deepspeed.py (DeepSpeed's peer rows) and the plan of benchmarks/gpu_check.sh,
without DeepSpeed or a GPU: the ZeRO-3 config it hands DeepSpeed, its errors, and the order
and commands the GPU call runs. The DeepSpeed run itself skips here (not a dependency)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_deepspeed  # noqa: E402


def test_the_zero3_config_is_the_rows_shape_with_both_offloads(tmp_path):
    args = gpu_deepspeed._parse(["--offload", "nvme", "--nvme", str(tmp_path)])
    config = gpu_deepspeed._ds_config(args)
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["bf16"]["enabled"]
    assert config["gradient_accumulation_steps"] == 1 and config["gradient_clipping"] == 0.0
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    for key in ("offload_optimizer", "offload_param"):
        assert zero[key]["device"] == "nvme" and zero[key]["nvme_path"] == str(tmp_path)
    # The parameter swap buffer holds llama-1b's embedding (128,256 x 2,048), its largest.
    assert zero["offload_param"]["buffer_size"] == 128256 * 2048
    cpu = gpu_deepspeed._ds_config(gpu_deepspeed._parse([]))["zero_optimization"]
    assert cpu["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_a_missing_nvme_directory_is_refused(tmp_path, capsys):
    assert gpu_deepspeed.main(["--offload", "nvme", "--nvme", str(tmp_path / "no")]) == 1
    out = capsys.readouterr().out
    assert "is not a directory; create it" in out and str(tmp_path / "no") in out


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is not None, reason="DeepSpeed is installed"
)
def test_without_deepspeed_the_build_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_deepspeed, "_single_rank_env", lambda: None)  # no env left behind
    out = tmp_path / "ds.json"
    assert gpu_deepspeed.main(["--build-only", "--json", str(out)]) == 1
    ops = json.loads(out.read_text())["ops"]
    assert not ops["cpu_adam"]["ok"] and ops["cpu_adam"]["error"].startswith("import deepspeed")


def test_the_gpu_call_runs_the_rows_first(tmp_path):
    env = dict(os.environ, GPU_CHECK_LIST_ONLY="1", OUT=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()[1:]
    names = [line.split()[0] for line in lines]
    assert names == ["machine", "ds_build", "install", "aio", "throughput", "deepspeed",
                     "throughput_big", "throughput_nvme", "deepspeed_nvme", "cuda_tests",
                     "smoke", "torchrun", "suite"]  # fmt: skip
    plan = dict(zip(names, lines, strict=True))
    assert "--cases 1b-ram " in plan["throughput"] and "--device cuda" in plan["throughput"]
    assert "--cases 13b-lora-resident,7b-full " in plan["throughput_big"]
    assert "--cases 1b-nvme " in plan["throughput_nvme"]
    for name, offload in (("deepspeed", "cpu"), ("deepspeed_nvme", "nvme")):
        assert "--model llama-1b" in plan[name] and f"--offload {offload}" in plan[name]
    assert not list(tmp_path.iterdir())  # listing runs nothing
