"""Claim: a sweep of `NvmeStateStore` (read sub-group i+1 and write back i-1 while i is
updated) keeps the disk as busy as raw `AioHandle` reads and writes of the same bytes.

Each round, interleaved so that the shared disk's swings hit every variant alike: raw writes
of the state's bytes over a laid-out file, raw reads of them (sub-group sized requests, one
at a time, like `infinity bench aio`), then one sweep with a trivial in-place update. The
sweep moves the state once each way, so its throughput is compared with the raw time to read
plus write the same bytes: `fraction_of_raw` = (raw read s + raw write s) / sweep s. Given
`--bench-aio-json` (from `infinity bench aio --json` on the same directory), the sweep is
also compared with that run's best read and write: `fraction_of_bench_aio_best`.

    flock /work/bench.lock python benchmarks/optimizer_swap_bench.py --path /tmp \\
        --state-gib 2 --json benchmarks/results/optimizer_swap.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time

import torch

from infinity.swap.aio import AioHandle, aligned_empty
from infinity.swap.nvme_state import NvmeStateStore
from infinity.swap.store import SwapStore, align_up

_GB = 1e9


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def raw_pass(aio: AioHandle, buf: torch.Tensor, path: str, chunks: int, write: bool) -> float:
    """Seconds to move `chunks` buffers to (or from) consecutive offsets of `path`."""
    op = aio.pwrite if write else aio.pread
    start = time.perf_counter()
    for c in range(chunks):
        op(buf, path, c * buf.numel()).wait()
    return time.perf_counter() - start


def sweep_pass(state: NvmeStateStore) -> float:
    start = time.perf_counter()
    for _, s in state.sweep():
        s.master.add_(1.0)  # stands in for the Adam step; memory-bound and cheap
    return time.perf_counter() - start


def measure(args: argparse.Namespace, aio: AioHandle, numel: int, groups: int) -> dict:
    """Interleaved rounds of raw write, raw read and sweep: seconds (and sweep waits) each."""
    state_bytes = groups * align_up(12 * numel)
    rows: dict[str, list[float]] = {"raw_write_s": [], "raw_read_s": [], "sweep_s": []}
    rows |= {"sweep_read_wait_s": [], "sweep_write_wait_s": []}
    with SwapStore(args.path, run_id=f"bench{os.getpid()}") as store:
        # No read-ahead into the next sweep: it would overlap the raw passes and hide reads.
        state = NvmeStateStore(
            [numel] * groups,
            store=store,
            aio=aio,
            buffer_count=args.buffer_count,
            prefetch_next_sweep=False,
        )
        for i in range(groups):
            state.initialize(i, torch.zeros(numel))
        raw_ext = store.reserve("raw", {"raw": state_bytes})["raw"]
        buf = aligned_empty(align_up(12 * numel), torch.uint8)
        buf.fill_(1)
        raw_pass(aio, buf, raw_ext.path, groups, write=True)  # lay the file out
        sweep_pass(state)  # warm-up; also settles the initial writes
        for _ in range(args.rounds):
            rows["raw_write_s"].append(raw_pass(aio, buf, raw_ext.path, groups, write=True))
            rows["raw_read_s"].append(raw_pass(aio, buf, raw_ext.path, groups, write=False))
            before = (state.stats.read_wait_s, state.stats.write_wait_s)
            rows["sweep_s"].append(sweep_pass(state))
            rows["sweep_read_wait_s"].append(state.stats.read_wait_s - before[0])
            rows["sweep_write_wait_s"].append(state.stats.write_wait_s - before[1])
        state.close()
    return rows


def run(args: argparse.Namespace) -> dict:
    numel = args.sub_group_numel
    groups = max(1, round(args.state_gib * (1 << 30) / (12 * numel)))
    state_bytes = groups * align_up(12 * numel)
    with AioHandle(
        block_size=args.block_size,
        queue_depth=args.queue_depth,
        threads=args.threads,
        backend=args.backend,
    ) as aio:
        rows = measure(args, aio, numel, groups)
    med = {k: statistics.median(v) for k, v in rows.items()}
    record = {
        "bench": "optimizer_swap",
        "path": os.path.abspath(args.path),
        "backend": aio.backend,
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "threads": args.threads,
        "buffer_count": args.buffer_count,
        "sub_group_numel": numel,
        "sub_groups": groups,
        "state_bytes": state_bytes,
        "rounds": args.rounds,
        **rows,
        "median_s": med,
        "raw_write_gbps": state_bytes / med["raw_write_s"] / _GB,
        "raw_read_gbps": state_bytes / med["raw_read_s"] / _GB,
        "sweep_gbps": 2 * state_bytes / med["sweep_s"] / _GB,
        "fraction_of_raw": (med["raw_read_s"] + med["raw_write_s"]) / med["sweep_s"],
        "machine": machine(),
    }
    if args.bench_aio_json:
        record.update(against_bench_aio(args.bench_aio_json, state_bytes, med["sweep_s"]))
    return record


def against_bench_aio(path: str, state_bytes: int, sweep_s: float) -> dict:
    """The sweep against the best read and write of an `infinity bench aio --json` run on the
    same directory: the time those would take to read and write the state, over the sweep's."""
    with open(path) as f:
        records = json.load(f)
    best = {op: max(r["gbps"] for r in records if r["op"] == op) for op in ("read", "write")}
    ideal_s = state_bytes / (best["read"] * _GB) + state_bytes / (best["write"] * _GB)
    return {
        "bench_aio_best_read_gbps": best["read"],
        "bench_aio_best_write_gbps": best["write"],
        "fraction_of_bench_aio_best": ideal_s / sweep_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default="/tmp", help="directory on the disk to measure")
    p.add_argument("--state-gib", type=float, default=2.0, help="fp32 state (master, m, v)")
    p.add_argument("--sub-group-numel", type=int, default=16 << 20)
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bench-aio-json", help="`infinity bench aio --json` output to compare to")
    p.add_argument("--json", default="optimizer_swap_bench.json", help="output file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    record = run(args)
    print(
        f"state {record['state_bytes'] / _GB:.2f} GB in {record['sub_groups']} sub-groups, "
        f"{record['backend']}: raw write {record['raw_write_gbps']:.2f} GB/s, raw read "
        f"{record['raw_read_gbps']:.2f} GB/s; sweep {record['sweep_gbps']:.2f} GB/s "
        f"(read+write), {record['fraction_of_raw']:.2f}x of raw read+write time"
    )
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
