"""Smoke test: `infinity bench adam` and benchmarks/adam_bench.py at a tiny size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.cli.bench_adam import BenchConfig, bytes_per_param, parse_count
from infinity.cli.main import main
from infinity.optim import native_adam

ROOT = Path(__file__).resolve().parents[1]


def test_cli_writes_json_with_every_row(tmp_path, capsys):
    out = tmp_path / "adam.json"
    argv = ["bench", "adam", "--numel", "3K", "--peer", "torch-fused", "--peer", "infinity",
            "--warmup", "0", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["config"]["numel"] == 3000
    assert record["copy"]["copy_GBps"] > 0
    rows = [r for r in record["rows"] if "skipped" not in r]
    impls = {"torch-fused"} | ({"infinity"} if native_adam.available() else set())
    assert {r["impl"] for r in rows} == impls
    assert len(rows) == len(impls) * 3 * 2  # three grad dtypes, with and without half copy
    assert all(r["median_ms"] > 0 and r["GBps"] > 0 for r in rows)
    assert "copy bandwidth" in capsys.readouterr().out


def test_script_runs(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "adam_bench.py"), "--numel", "2K",
           "--peer", "torch-foreach", "--dtype", "bf16", "--warmup", "0", "--repeats", "1",
           "--json", str(out)]  # fmt: skip
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    assert records[0]["rows"][0]["grad"] == "bf16"


def test_config_and_counts_are_checked():
    assert parse_count("100M") == 100_000_000 and parse_count("1.5K") == 1500
    assert bytes_per_param("fp32", False) == 28 and bytes_per_param("bf16", True) == 28
    with pytest.raises(ValueError, match="cannot read"):
        parse_count("lots")
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        BenchConfig(dtypes=["fp8"])
    with pytest.raises(ValueError, match="peer"):
        BenchConfig(peers=["apex"])
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        BenchConfig(threads=0)


@pytest.mark.skipif(not native_adam.available(), reason="infinity._cpu_adam is not built")
def test_threads_apply_to_the_run_and_are_restored(tmp_path):
    out = tmp_path / "one.json"
    before = native_adam.num_threads()
    argv = ["bench", "adam", "--numel", "3K", "--peer", "infinity", "--dtype", "fp32",
            "--threads", "1", "--warmup", "0", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    machine = json.loads(out.read_text())["machine"]
    assert machine["native_threads"] == 1 and machine["torch_threads"] == 1
    assert native_adam.num_threads() == before


def test_the_8_bit_rows_sit_beside_torchaos(tmp_path):
    out = tmp_path / "adam8.json"
    argv = ["bench", "adam", "--numel", "8K", "--peer", "infinity-8bit", "--peer", "torchao-8bit",
            "--dtype", "bf16", "--warmup", "1", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    ours = [r for r in rows if r["impl"] == "infinity-8bit"]
    if native_adam.available8():
        assert len(ours) == 2 and all(r["bytes_per_param"] in (14, 16) for r in ours)
    peer = [r for r in rows if r["impl"] == "torchao-8bit"]
    assert peer and (all("skipped" in r for r in peer) or len(peer) == 2)
    assert bytes_per_param("bf16", False, eight_bit=True) == 14


def test_bad_flags_are_refused_with_the_fix_before_measuring(tmp_path, capsys):
    """A count argparse cannot read keeps parse_count's message (argparse alone printed
    "invalid parse_count value"); 1e6 is a count; an unwritable --json is refused before the
    minutes of measuring, not after them."""
    assert parse_count("1e6") == 1_000_000 and parse_count("2.5E7") == 25_000_000
    with pytest.raises(SystemExit):
        main(["bench", "adam", "--numel", "lots"])
    assert "cannot read 'LOTS' as a count; write e.g. 100M" in capsys.readouterr().err
    for where in (tmp_path / "absent" / "a.json", tmp_path):
        argv = ["bench", "adam", "--numel", "1K", "--peer", "infinity", "--json", str(where)]
        assert main(argv) == 1
        out = capsys.readouterr()
        assert f"--json {where}" in out.err and "copy bandwidth" not in out.out
