"""benchmarks/reported_pages.py: the balloon's feature bits are read right, and it runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from reported_pages import balloon_reports_free_pages  # noqa: E402


def _device(root: Path, name: str, device_id: str, bits: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "device").write_text(device_id + "\n")
    (root / name / "features").write_text(bits + "\n")


def test_reporting_bit_of_the_balloon_only(tmp_path):
    assert balloon_reports_free_pages(tmp_path) is None  # no virtio devices at all
    _device(tmp_path, "virtio1", "0x0002", "0" * 5 + "1" + "0" * 58)  # a disk with bit 5 set
    assert balloon_reports_free_pages(tmp_path) is None
    _device(tmp_path, "virtio0", "0x0005", "0110010" + "0" * 57)  # bits 1, 2, 5
    assert balloon_reports_free_pages(tmp_path) is True
    (tmp_path / "virtio0" / "features").write_text("0110000" + "0" * 57)
    assert balloon_reports_free_pages(tmp_path) is False


def test_runs_tiny(tmp_path, run_bench):
    out = tmp_path / "r.json"
    args = ["--gib", "0.01", "--idle", "0", "--rounds", "1", "--json", str(out)]
    proc = run_bench("benchmarks/reported_pages.py", *args)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert [r["tag"] for r in rec["records"]] == ["after_0s_idle", "right_after_a_free"]
    assert all(r["first_gb_s"] > 0 and r["again_gb_s"] > 0 for r in rec["records"])
    assert "balloon_reports_free_pages" in rec["machine"]
