"""Claim: a sweep of `NvmeStateTier` (read sub-group i+1 and write back i-1 while i is
updated) keeps the disk as busy as raw `AioHandle` reads and writes of the same bytes.

Each round, interleaved so that the shared disk's swings hit every variant alike: raw writes
of the state's bytes over a laid-out file, raw reads of them (sub-group sized requests, one
at a time, like `infinity bench aio`), then one sweep with a trivial in-place update for each
host buffer count asked for (`--buffer-count 3,4,6`). The
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
import statistics
import sys
import time

import torch
from bench_record import machine, write_json

from infinity.io.aio import AioHandle, aligned_empty
from infinity.swap.nvme_state import NvmeStateTier
from infinity.swap.store import SwapStore, align_up

_GB = 1e9


def raw_pass(aio: AioHandle, buf: torch.Tensor, path: str, chunks: int, write: bool) -> float:
    """Seconds to move `chunks` buffers to (or from) consecutive offsets of `path`."""
    op = aio.pwrite if write else aio.pread
    start = time.perf_counter()
    for c in range(chunks):
        op(buf, path, c * buf.numel()).wait()
    return time.perf_counter() - start


def sweep_pass(state: NvmeStateTier) -> float:
    start = time.perf_counter()
    for _, s in state.sweep():
        s.master.add_(1.0)  # stands in for the Adam step; memory-bound and cheap
    return time.perf_counter() - start


def measure(args: argparse.Namespace, aio: AioHandle, numel: int, groups: int) -> dict:
    """Interleaved rounds of raw write, raw read and one sweep per buffer count: seconds each
    (and the sweeps' waits)."""
    state_bytes = groups * align_up(12 * numel)
    rows: dict[str, list[float]] = {"raw_write_s": [], "raw_read_s": []}
    with SwapStore(args.path, run_id=f"bench{os.getpid()}") as store:
        states = {}
        for count in args.buffer_count:
            # No read-ahead into the next sweep: it would overlap the raw passes, hiding reads.
            states[count] = NvmeStateTier(
                [numel] * groups,
                store=store,
                aio=aio,
                buffer_count=count,
                prefetch_next_sweep=False,
                kind=f"optim.b{count}",
            )
            for i in range(groups):
                states[count].initialize(i, torch.zeros(numel))
            sweep_pass(states[count])  # warm-up; also settles the initial writes
            for key in ("sweep_s", "read_wait_s", "write_wait_s"):
                rows[f"b{count}_{key}"] = []
        raw_ext = store.reserve("raw", {"raw": state_bytes})["raw"]
        buf = aligned_empty(align_up(12 * numel), torch.uint8)
        buf.fill_(1)
        raw_pass(aio, buf, raw_ext.path, groups, write=True)  # lay the file out
        counts = list(states)
        for r in range(args.rounds):
            rows["raw_write_s"].append(raw_pass(aio, buf, raw_ext.path, groups, write=True))
            rows["raw_read_s"].append(raw_pass(aio, buf, raw_ext.path, groups, write=False))
            # The order rotates: a sweep pays for the disk flushing what ran just before it.
            for count in counts[r % len(counts) :] + counts[: r % len(counts)]:
                state = states[count]
                before = (state.stats.read_wait_s, state.stats.write_wait_s)
                rows[f"b{count}_sweep_s"].append(sweep_pass(state))
                rows[f"b{count}_read_wait_s"].append(state.stats.read_wait_s - before[0])
                rows[f"b{count}_write_wait_s"].append(state.stats.write_wait_s - before[1])
        for state in states.values():
            state.close()
    return rows


def state_groups(args: argparse.Namespace) -> tuple[int, int, int]:
    """(elements per sub-group, sub-groups, state bytes on disk) for --state-gib of fp32
    master + m + v in sub-groups of --sub-group-numel."""
    numel = args.sub_group_numel
    groups = max(1, round(args.state_gib * (1 << 30) / (12 * numel)))
    return numel, groups, groups * align_up(12 * numel)


def open_aio(args: argparse.Namespace) -> AioHandle:
    """The handle the flags describe (--block-size, --queue-depth, --threads, --backend)."""
    return AioHandle(
        block_size=args.block_size,
        queue_depth=args.queue_depth,
        threads=args.threads,
        backend=args.backend,
    )


def run(args: argparse.Namespace) -> dict:
    numel, groups, state_bytes = state_groups(args)
    with open_aio(args) as aio:
        rows = measure(args, aio, numel, groups)
    med = {k: statistics.median(v) for k, v in rows.items()}
    best = read_bench_aio(args.bench_aio_json) if args.bench_aio_json else None
    variants = []
    for count in args.buffer_count:
        sweep_s = med[f"b{count}_sweep_s"]
        v = {
            "buffer_count": count,
            "sweep_gbps": 2 * state_bytes / sweep_s / _GB,
            "fraction_of_raw": (med["raw_read_s"] + med["raw_write_s"]) / sweep_s,
            **{k.removeprefix(f"b{count}_"): rows[k] for k in rows if k.startswith(f"b{count}_")},
        }
        if best is not None:
            ideal_s = state_bytes / (best["read"] * _GB) + state_bytes / (best["write"] * _GB)
            v["fraction_of_bench_aio_best"] = ideal_s / sweep_s
        variants.append(v)
    return {
        "bench": "optimizer_swap",
        "path": os.path.abspath(args.path),
        "backend": aio.backend,
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "threads": args.threads,
        "sub_group_numel": numel,
        "sub_groups": groups,
        "state_bytes": state_bytes,
        "rounds": args.rounds,
        "raw_write_s": rows["raw_write_s"],
        "raw_read_s": rows["raw_read_s"],
        "raw_write_gbps": state_bytes / med["raw_write_s"] / _GB,
        "raw_read_gbps": state_bytes / med["raw_read_s"] / _GB,
        **({"bench_aio_best_gbps": best} if best is not None else {}),
        "variants": variants,
        "machine": machine(),
    }


def read_bench_aio(path: str) -> dict[str, float]:
    """The best read and write GB/s of an `infinity bench aio --json` run."""
    with open(path) as f:
        records = json.load(f)
    return {op: max(r["gbps"] for r in records if r["op"] == op) for op in ("read", "write")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default="/tmp", help="directory on the disk to measure")
    p.add_argument("--state-gib", type=float, default=2.0, help="fp32 state (master, m, v)")
    p.add_argument("--sub-group-numel", type=int, default=16 << 20)
    p.add_argument(
        "--buffer-count",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[4],
        help="host buffers of the store; a list (3,4,6) sweeps each, interleaved",
    )
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
        f"{record['raw_read_gbps']:.2f} GB/s"
    )
    for v in record["variants"]:
        print(
            f"  {v['buffer_count']} buffers: sweep {v['sweep_gbps']:.2f} GB/s (read+write), "
            f"{v['fraction_of_raw']:.2f}x of raw read+write time"
            + (
                f", {v['fraction_of_bench_aio_best']:.2f}x of bench aio's best"
                if "fraction_of_bench_aio_best" in v
                else ""
            )
        )
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
