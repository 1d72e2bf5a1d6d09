"""benchmarks/grad_norm_bench.py runs end to end at a tiny size."""

from __future__ import annotations

import json
import math


def test_grad_norm_bench_tiny(tmp_path, run_bench):
    out = tmp_path / "r.json"
    args = ["--numel", "300000", "--sub-group-size", "65536", "--repeats", "3"]
    proc = run_bench("benchmarks/grad_norm_bench.py", *args, "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert set(rec["median_s"]) == {"previous", "exact", "previous_sums_only", "exact_sums_only"}
    assert rec["exact_over_previous"] > 0 and rec["exact_over_previous_paired"] > 0
    norms = rec["norms"]  # the same gradient: the rules agree to fp32 rounding of the rows
    assert math.isclose(norms["exact"], norms["previous"], rel_tol=1e-6)
    assert norms["exact_sums_only"] == norms["exact"]
    assert json.loads(proc.stdout) == rec
