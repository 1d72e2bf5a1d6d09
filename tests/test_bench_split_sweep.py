"""benchmarks/split_sweep_bench.py and estimate_fixed_probes.py run end to end at a tiny size."""

from __future__ import annotations

import json


def test_split_sweep_bench_tiny(tmp_path, run_bench):
    out, swap = tmp_path / "r.json", tmp_path / "swap"
    args = ["--path", str(swap), "--ram-gib", "0.0004", "--nvme-gib", "0.0002"]
    args += ["--sub-group-numel", "4096", "--rounds", "2", "--backend", "posix", "--json", str(out)]
    proc = run_bench("-m", "benchmarks.split_sweep_bench", *args)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert (rec["sub_groups_in_ram"], rec["sub_groups_on_nvme"]) == (9, 4)
    assert rec["order"][0] == 9 and sorted(rec["order"]) == list(range(13))
    for name in ("interleaved", "ram_first", "nvme_alone"):
        assert len(rec["sweep_s"][name]) == 2 and rec["median_s"][name] > 0
    assert list(swap.iterdir()) == []  # the swap store cleaned up


def test_estimate_fixed_probes_sets_the_cpu_rates(tmp_path, run_bench):
    out = tmp_path / "e.json"
    rates = ["--adam-numel-per-s", "1e9", "--norm-bytes-per-s", "2e10"]
    est = ["--model", "llama-1b", "--device", "h100", "--seq-len", "256", "--json", str(out)]
    proc = run_bench("benchmarks/estimate_fixed_probes.py", *rates, "--", *est, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert rec["rates"]["adam_numel_per_s"] == 1e9
    assert rec["rates"]["norm_bytes_per_s"] == 2e10
