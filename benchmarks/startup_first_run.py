"""Claim under test: a start is slow when it must first take its memory back from the page
cache (the first run of a `startup.py` call, after other work filled the cache).

Alternates, per round: (a) the page cache filled by reading a file of `--fill-gib` GiB (or,
with `--idle S`, S seconds of idleness instead), then one `startup.py` run; (b) one run
right after (the previous run's memory just freed). Each run records the kernel's reclaim
counters (/proc/vmstat deltas: pages scanned and stolen by kswapd and by direct reclaim),
MemFree and Cached before it, and the load. `--probe-gib N` adds the same comparison
outside Infinity: N GiB of fresh anonymous memory written once, page by page, after a cache
fill and right after an equal touch was freed.

    PYTHONPATH=$PWD INFINITY_ACCELERATOR=cpu python benchmarks/startup_first_run.py \\
        --nvme /tmp/sf/nvme --fill /tmp/sf/fill.bin --rounds 2 --probe-gib 12 --json out.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_record import machine, write_json

_VM = ("pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct", "allocstall_movable")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme", required=True)
    p.add_argument("--fill", required=True, help="a file read to fill the page cache")
    p.add_argument("--fill-gib", type=int, default=8)
    p.add_argument("--idle", type=float, default=0, help="(a) waits this long instead of a fill")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--probe-gib", type=int, default=0)
    p.add_argument("--json", default="startup_first_run.json")
    args = p.parse_args(argv)
    fill = Path(args.fill)
    if not fill.exists() or fill.stat().st_size < args.fill_gib << 30:
        with fill.open("wb") as f:  # written once; later rounds only read it
            for _ in range(args.fill_gib * 64):
                f.write(b"\1" * (16 << 20))
    runs, probe = [], []
    for k in range(args.rounds):
        first = f"after_idle_{args.idle:g}s" if args.idle else "after_cache_fill"
        for tag in (first, "right_after_a_run"):
            if tag == first and args.idle:
                time.sleep(args.idle)
            runs.append(_measured(tag, k, fill if tag == "after_cache_fill" else None, args))
            print(json.dumps(runs[-1]), flush=True)
    for k in range(args.rounds if args.probe_gib else 0):
        for tag in ("after_cache_fill", "right_after_a_touch"):
            pre = fill if tag == "after_cache_fill" else None
            probe.append({"tag": tag, "round": k, **_counted(pre, _touch, args.probe_gib)})
            print(json.dumps(probe[-1]), flush=True)
    write_json({"claim": __doc__.split("\n\n")[0], "machine": machine(args.nvme),
                "runs": runs, "first_touch_probe": probe}, args.json)  # fmt: skip
    return 0


def _measured(tag: str, k: int, fill: Path | None, args) -> dict:
    out = Path(tempfile.mkdtemp(prefix="sfr-")) / "run.json"
    cmd = [sys.executable, str(Path(__file__).with_name("startup.py")), "--preset", "llama-1b",
           "--nvme", args.nvme, "--repeats", "1", "--json", str(out)]  # fmt: skip
    rec = _counted(fill, lambda: subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False))
    r = json.loads(out.read_text())["runs"][0]
    rec.pop("seconds")
    return {"tag": tag, "round": k, **rec, "before_step1_s": r["before_step1_s"],
            "model_s": r["phases_s"].get("model"),
            "optimizer_s": r["engine_phases_s"].get("optimizer"),
            "step1_s": r["step1_s"], "peak_rss_bytes": r["peak_rss_bytes"]}  # fmt: skip


def _counted(fill: Path | None, work, *a) -> dict:
    """`work(*a)` timed, with the reclaim counters' deltas, after reading `fill` if given."""
    if fill is not None:
        subprocess.run(["cat", str(fill)], stdout=subprocess.DEVNULL, check=True)
    mem, before, load = _meminfo(), _vmstat(), os.getloadavg()
    t = time.perf_counter()
    work(*a)
    seconds, after = time.perf_counter() - t, _vmstat()
    return {"load_1m_before": load[0], "load_1m_after": os.getloadavg()[0],
            "mem_before_mib": mem, "seconds": seconds,
            "vmstat_delta": {n: after[n] - before[n] for n in _VM}}  # fmt: skip


def _touch(gib: int) -> None:
    """Write one byte in every 4 KiB page of `gib` GiB of fresh private anonymous memory."""
    m = mmap.mmap(-1, gib << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        for off in range(0, gib << 30, 4096):
            m[off] = 1
    finally:
        m.close()


def _vmstat() -> dict[str, int]:
    d = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return {n: int(d.get(n, 0)) for n in _VM}


def _meminfo() -> dict[str, int]:
    lines = Path("/proc/meminfo").read_text().splitlines()
    d = {x.split(":")[0]: int(x.split()[1]) for x in lines}
    return {n: d[n] // 1024 for n in ("MemFree", "Cached", "MemAvailable")}


if __name__ == "__main__":
    sys.exit(main())
