"""Smoke test: `infinity bench aio` at a tiny size, its JSON records and its summary."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.cli.bench_aio import AioBenchConfig, best, parse_bool, parse_list
from infinity.cli.main import main
from infinity.io import available_backends
from infinity.utils.sizes import parse_size

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"op", "backend", "block_size", "queue_depth", "threads", "gbps"}


def test_cli_sweep_writes_records(tmp_path, capsys):
    out = tmp_path / "aio.json"
    argv = ["bench", "aio", "--path", str(tmp_path), "--size", "1M", "--block-size",
            "64K,256K", "--queue-depth", "2,8", "--threads", "1,2", "--backend", "all",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = json.loads(out.read_text())
    assert records[-1]["fresh_file"] and records[-1]["op"] == "write"
    records = [r for r in records if not r["fresh_file"]]
    backends = available_backends()
    assert len(records) == len(backends) * 2 * 2 * 2 * 2  # x block sizes, depths, threads, ops
    assert all(set(r) >= KEYS and r["gbps"] > 0 for r in records)
    assert {r["backend"] for r in records} == set(backends)
    assert {r["op"] for r in records} == {"read", "write"}
    assert not (tmp_path / "infinity_aio_bench.bin").exists()  # cleaned up
    text = capsys.readouterr().out
    top_read = max(r["gbps"] for r in records if r["op"] == "read")
    top_write = max(r["gbps"] for r in records if r["op"] == "write")
    assert f"Best performance (GB/sec): read = {top_read:.2f}, write = {top_write:.2f}" in text
    assert "first write into a fresh file" in text
    section = json.loads(text[text.index('{\n  "aio"') :].split("\nwrote")[0])["aio"]
    assert set(section) == {"block_size", "queue_depth", "thread_count", "single_submit",
                            "overlap_events", "backend"}  # fmt: skip
    assert all((r["single_submit"], r["overlap_events"]) == (False, True) for r in records)


def test_sweeps_single_submit_and_overlap_events(tmp_path, capsys):
    out = tmp_path / "aio.json"
    argv = ["bench", "aio", "--path", str(tmp_path), "--size", "512K", "--block-size", "64K",
            "--queue-depth", "4", "--threads", "1", "--single-submit", "false,true",
            "--overlap-events", "true,false", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = [r for r in json.loads(out.read_text()) if not r["fresh_file"]]
    modes = {(r["op"], r["single_submit"], r["overlap_events"]) for r in records}
    assert len(records) == len(modes) == 2 * 2 * 2
    table = capsys.readouterr().out
    assert "single" in table and "overlap" in table
    section = json.loads(table[table.index('{\n  "aio"') :].split("\nwrote")[0])["aio"]
    assert isinstance(section["single_submit"], bool)
    with pytest.raises(ValueError, match="boolean"):
        parse_bool("maybe")


def test_read_only_and_auto(tmp_path):
    out = tmp_path / "aio.json"
    argv = ["bench", "aio", "--path", str(tmp_path), "--size", "512K", "--block-size", "128K",
            "--queue-depth", "4", "--threads", "1", "--read", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = json.loads(out.read_text())
    assert [(r["op"], r["fresh_file"]) for r in records] == [("read", False), ("write", True)]
    assert records[0]["backend"] == available_backends()[0]


def test_best_picks_balanced_config():
    rec = lambda op, b, g: {"op": op, "backend": b, "block_size": 1, "queue_depth": 1,  # noqa: E731
                            "threads": 1, "gbps": g}  # fmt: skip
    result = {"records": [rec("read", "a", 1.0), rec("write", "a", 1.0),
                          rec("read", "b", 2.0), rec("write", "b", 0.1)]}  # fmt: skip
    b = best(result)
    assert (b["read"], b["write"]) == (2.0, 1.0)
    assert b["aio"]["backend"] == "a"  # 0.5 + 1.0 beats 1.0 + 0.1


def test_arguments_are_checked(tmp_path):
    assert parse_size("4G") == 4 << 30 and parse_size("128K") == 131072
    assert parse_list("128K,1M", parse_size) == [131072, 1 << 20]
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="not a directory"):
        AioBenchConfig(path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="multiple of 4096"):
        AioBenchConfig(path=str(tmp_path), block_sizes=[1000])
    with pytest.raises(ValueError, match="does not run here|not one of"):
        AioBenchConfig(path=str(tmp_path), backends=["spdk"])
    assert main(["bench", "aio", "--path", str(tmp_path / "missing")]) == 1


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)


def test_aio_bench_script(tmp_path):
    out = tmp_path / "r.json"
    proc = _script("aio_bench.py", "--path", str(tmp_path), "--size", "256K", "--block-size",
                   "64K", "--queue-depth", "4", "--threads", "1", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    assert [(r["op"], r["fresh_file"]) for r in records] == [
        ("read", False), ("write", False), ("write", True)
    ]  # fmt: skip
    assert "Best performance (GB/sec)" in proc.stdout


@pytest.fixture(scope="module")
def fio():
    """fio, installed the way the script installs it (Debian's package) when it is missing."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.aio_vs_fio import ensure_fio
    finally:
        sys.path.remove(str(ROOT))
    found = shutil.which("fio") or ensure_fio()
    if found is None:
        pytest.skip("fio is not installed and apt-get could not install it (not root?)")
    return found


def test_aio_vs_fio_script(tmp_path, fio):
    out = tmp_path / "r.json"
    proc = _script("aio_vs_fio.py", "--path", str(tmp_path), "--size", "1M", "--rounds", "2",
                   "--backend", "posix", "--fio-hugepages", "off", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert len(result["records"]) == 2 * 2 * 4  # rounds x ops x runners
    assert {r["tool"] for r in result["records"]} == {"infinity", "fio"}
    for op in ("read", "write"):
        s = result["summary"][op]
        assert s["best_backend"] == "posix"
        assert set(s["median_gbps"]) == {"posix", "posix+4k-pages", "posix+fio-buffer", "libaio"}
        assert s["ratio_best_to_fio"] == pytest.approx(
            s["median_gbps"]["posix"] / s["median_gbps"]["libaio"]
        )
    assert "/ fio =" in proc.stdout
    assert not (tmp_path / "infinity_aio_bench.bin").exists()


def test_an_unwritable_json_is_refused_before_the_sweep(tmp_path, capsys):
    """The sweep takes minutes: a --json that cannot be written is refused first, by the
    check `infinity estimate` and `bench adam` share (infinity.utils.fsio)."""
    from infinity.cli.main import main

    for where, why in ((tmp_path / "absent" / "a.json", "does not exist"), (tmp_path, "directory")):
        argv = ["bench", "aio", "--path", str(tmp_path), "--json", str(where)]
        assert main(argv) == 1
        out = capsys.readouterr()
        assert f"--json {where}" in out.err and why in out.err and "Traceback" not in out.err
        assert "GB/s" not in out.out  # nothing measured
