"""The peak RSS a run reports is its own: a process started by a larger one (a test runner,
a notebook) does not report its parent's peak (Linux keeps ru_maxrss across exec)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from infinity.utils.telemetry import peak_rss_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_reports_its_own_peak_not_its_parents():
    parent = bytearray(400 << 20)
    parent[::4096] = b"\1" * len(range(0, len(parent), 4096))  # touch every page
    assert peak_rss_bytes() >= 400 << 20
    code = "from infinity.utils.telemetry import peak_rss_bytes as p; print(p())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 200 << 20, int(out.stdout) >> 20
    del parent
