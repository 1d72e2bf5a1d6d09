"""Claim: with parameters and optimizer states on NVMe, a full bf16 fine-tune's host RAM is
set by the config, not by the model: peak RSS within 1 GiB of the 0.5B figure from 0.5B to
3B parameters and under 6 GiB at 3B, with the optimizer step within 1.2x of its I/O bound.

One run, on the `--path` directory:
1. `infinity bench aio --json` in a subprocess (as in bigger_than_ram.py): best read and
   best write GB/s.
2. For each size in `--sizes`, in a fresh interpreter (so each has its own peak RSS): a
   Llama shape of that many parameters (`bigger_than_ram.model_config`) built under
   `infinity.init` with `offload_param` and `offload_optimizer` on NVMe (the config of
   `bigger_than_ram.engine_config`), `infinity.initialize`, then `--steps` steps of batch 1 x
   `--seq-len` random tokens with activation checkpointing (`bigger_than_ram.train`).

Figures per size (medians over the steps after the first where they are per step):
- build peak: `VmHWM` after the model is built, and the anonymous RSS (`RssAnon`) then;
- peak RSS: `VmHWM` at the end (after the steps and `close()`);
- disk bytes: the size of the files under `--path` after `initialize` (every swap extent);
- optimizer step time, and its I/O bound: bytes the step read / best read + bytes it wrote
  / best write, counting every NVMe counter of `memory_stats()` (optimizer state, new
  weights, gradients); io ratio = step time / I/O bound;
- gather waits: time forward+backward waited on parameter reads (`nvme_param_wait_us`).
Checks: every peak RSS within 1 GiB of the first size's, peak RSS under 6 GiB at the largest
size, io ratio <= 1.2 at every size.

    flock /work/bench.lock python benchmarks/ram_floor.py --path /tmp/ram_floor \\
        --json benchmarks/results/ram_floor_2026-11-23.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time

from bench_record import machine, write_json

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bigger_than_ram as btr  # noqa: E402  (the pieces this claim shares)

_GB = 1e9
_GIB = 1 << 30

log = logging.getLogger("ram_floor")


def _disk_bytes(path: str) -> int:
    """Bytes allocated by the files under `path` (the swap store's extents)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # removed while we walk
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def one_size(args: argparse.Namespace) -> dict:
    """Build, initialize, train and close one model (runs in the child)."""
    import torch

    import infinity
    from infinity.models import LlamaForCausalLM
    from infinity.utils.telemetry import peak_rss_bytes

    mcfg = btr.model_config(args.one, args.vocab)
    aio = json.loads(args.aio_section)
    args.param_tier, args.param_buffer_count = "nvme", 0
    config = btr.engine_config(args, mcfg, aio)
    rss = {"baseline_peak": peak_rss_bytes(), "baseline_anon": btr._proc_status("RssAnon")}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with infinity.init(config):
        model = LlamaForCausalLM(mcfg)
    model.set_gradient_checkpointing(True)
    rss["build_peak"] = peak_rss_bytes()
    rss["build_anon"] = btr._proc_status("RssAnon")
    t1 = time.perf_counter()
    engine = infinity.initialize(model, config)
    try:
        rss["init_peak"] = peak_rss_bytes()
        t2 = time.perf_counter()
        disk = _disk_bytes(args.path)
        print(
            f"{mcfg.num_params:,} parameters: built in {t1 - t0:.1f} s (peak RSS "
            f"{rss['build_peak'] / _GIB:.2f} GiB), initialized in {t2 - t1:.1f} s (peak RSS "
            f"{rss['init_peak'] / _GIB:.2f} GiB), {disk / _GB:.1f} GB on disk",
            flush=True,
        )
        steps = btr.train(engine, args, mcfg.vocab_size, probes=False)
        stats = engine.memory_stats()
    finally:
        engine.close()
    rss["end_peak"] = peak_rss_bytes()
    return {
        "params": mcfg.num_params,
        "model": {k: getattr(mcfg, k) for k in ("vocab_size", "hidden_size",
                  "intermediate_size", "num_hidden_layers", "num_attention_heads")},
        "config": config,
        "build_s": t1 - t0,
        "initialize_s": t2 - t1,
        "disk_bytes": disk,
        "rss_bytes": rss,
        "steps": steps,
        "memory_stats": stats,
    }  # fmt: skip


def run_size(args: argparse.Namespace, params: float, aio: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(params), "--path", args.path]
    cmd += ["--aio-section", json.dumps(aio["best_aio_section"]), "--vocab", str(args.vocab)]
    cmd += ["--steps", str(args.steps), "--seq-len", str(args.seq_len)]
    cmd += ["--sub-group-size", str(args.sub_group_size), "--malloc", args.malloc]
    log.info("running %s", shlex.join(cmd))
    proc = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), flush=True)
    return json.loads(lines[-1])


def summarize_size(rec: dict, aio: dict) -> dict:
    read_bps, write_bps = aio["best_read_gbps"] * _GB, aio["best_write_gbps"] * _GB
    later = rec["steps"][1:] or rec["steps"]
    cols: dict[str, list[float]] = {}
    for s in later:
        bound = s["step_bytes_read"] / read_bps + s["step_bytes_written"] / write_bps
        for key, value in (
            ("optimizer_step_s", s["optimizer_step_s"]),
            ("io_bound_s", bound),
            ("io_ratio", s["optimizer_step_s"] / bound),
            ("fwd_bwd_s", s["fwd_bwd_s"]),
            ("step_wall_s", s["wall_s"]),
            ("gather_wait_s", s["fwd_bwd_nvme"].get("nvme_param_wait_us", 0) / 1e6),
            ("step_bytes_read", s["step_bytes_read"]),
            ("step_bytes_written", s["step_bytes_written"]),
        ):
            cols.setdefault(key, []).append(value)
    med = {k: statistics.median(v) for k, v in cols.items()}
    rss = rec["rss_bytes"]
    return {
        "params": rec["params"],
        "peak_rss_bytes": rss["end_peak"],
        "build_peak_rss_bytes": rss["build_peak"],
        "build_anon_growth_bytes": rss["build_anon"] - rss["baseline_anon"],
        "disk_bytes": rec["disk_bytes"],
        "grad_host_bytes": rec["memory_stats"].get("grad_bytes", 0),
        "gather_wait_s_per_step": cols["gather_wait_s"],
        **med,
    }


def report(rows: list[dict], checks: dict) -> None:
    print(
        "params | peak RSS | build peak (anon growth) | disk | step wall | optimizer step "
        "(I/O bound, ratio) | gather waits after step 1"
    )
    for r in rows:
        waits = ", ".join(f"{w:.2f}" for w in r["gather_wait_s_per_step"])
        print(
            f"{r['params'] / 1e9:.2f}B | {r['peak_rss_bytes'] / _GIB:.2f} GiB | "
            f"{r['build_peak_rss_bytes'] / _GIB:.2f} GiB "
            f"({r['build_anon_growth_bytes'] / 2**20:.0f} MiB) | {r['disk_bytes'] / _GB:.1f} GB | "
            f"{r['step_wall_s']:.1f} s | {r['optimizer_step_s']:.2f} s ({r['io_bound_s']:.2f} s, "
            f"{r['io_ratio']:.2f}) | {waits} s"
        )
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default="/tmp/ram_floor", help="NVMe directory (created if missing)")
    p.add_argument("--sizes", default="0.5e9,1e9,2e9,3e9", help="parameter counts, comma-separated")
    p.add_argument("--vocab", type=int, default=32000, help="largest vocabulary to use")
    p.add_argument("--sub-group-size", type=float, default=2.5e7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--rss-limit-gib", type=float, default=6.0, help="at the largest size")
    p.add_argument("--rss-spread-gib", type=float, default=1.0, help="above the first size's")
    p.add_argument("--aio-args", default="--size 2G", help="extra `infinity bench aio` args")
    p.add_argument("--malloc", choices=("unmap", "default"), default="unmap")
    p.add_argument("--one", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--aio-section", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--json", default="ram_floor.json", help="output file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.malloc == "unmap":
        from infinity.utils.host_memory import unmap_large_allocations

        unmap_large_allocations()
    os.makedirs(args.path, exist_ok=True)
    if args.one:  # the child of run_size()
        print(json.dumps(one_size(args)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    record: dict = {"bench": "ram_floor", "machine": machine(args.path), "args": vars(args)}
    aio = btr.bench_aio(args.path, shlex.split(args.aio_args))
    print(
        f"bench aio: best read {aio['best_read_gbps']:.2f} GB/s, best write "
        f"{aio['best_write_gbps']:.2f} GB/s",
        flush=True,
    )
    runs = [run_size(args, float(s), aio) for s in args.sizes.split(",")]
    rows = [summarize_size(r, aio) for r in runs]
    first, last = rows[0]["peak_rss_bytes"], rows[-1]["peak_rss_bytes"]
    checks = {
        f"peak_rss_within_{args.rss_spread_gib:g}_GiB_of_the_first": all(
            r["peak_rss_bytes"] - first <= args.rss_spread_gib * _GIB for r in rows
        ),
        f"peak_rss_under_{args.rss_limit_gib:g}_GiB_at_the_largest": last
        < args.rss_limit_gib * _GIB,
        "io_ratio_at_most_1.2": all(r["io_ratio"] <= 1.2 for r in rows),
    }
    record.update(bench_aio=aio, runs=runs, summary={"rows": rows, "checks": checks})
    record["machine"]["loadavg_end"] = os.getloadavg()
    report(rows, checks)
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
