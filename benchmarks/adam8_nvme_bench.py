"""Claim: with the optimizer state on NVMe, an 8-bit Adam step is faster than a 32-bit one:
it moves about half the bytes, and the kernel's extra work overlaps the transfers.

Each round, interleaved so the shared disk's swings hit both alike: one sweep of an
`NvmeStateTier` of each format (32-bit: master, exp_avg, exp_avg_sq; 8-bit: master, codes,
absmax) over the same number of parameters, running the real step on each sub-group
(`adam_step_flat` or `adam8_step_flat`, bf16 gradients and a bf16 copy of the new weights,
as the engine does). Reports seconds per step, the bytes each sweep read, and the ratio.

    python benchmarks/adam8_nvme_bench.py --path /tmp --numel 64M --rounds 5 \\
        --json benchmarks/results/adam8_nvme.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from bench_record import machine, write_json

from infinity.cli.bench_adam import parse_count
from infinity.io.aio import AioHandle
from infinity.optim import AdamHyper, adam_step_flat
from infinity.optim.adam8 import adam8_step_flat
from infinity.swap.nvme_state import NvmeStateTier
from infinity.swap.state_format import StateFormat, SubGroupState8
from infinity.swap.store import SwapStore

HYPER = AdamHyper(lr=1e-4, weight_decay=0.01)


def sweep(tier: NvmeStateTier, grad: torch.Tensor, half: torch.Tensor, step: int) -> float:
    """Seconds of one optimizer step over every sub-group of `tier`."""
    start = time.perf_counter()
    for _, s in tier.sweep():
        if isinstance(s, SubGroupState8):
            moments = (s.exp_avg, s.exp_avg_sq, s.exp_avg_absmax, s.exp_avg_sq_absmax)
            adam8_step_flat(s.master, grad, *moments, step=step, hyper=HYPER, half_out=half)
        else:
            adam_step_flat(s.master, grad, s.exp_avg, s.exp_avg_sq, step=step, hyper=HYPER,
                           half_out=half)  # fmt: skip
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict:
    groups = max(1, args.numel // args.sub_group)
    numel = args.sub_group
    grad = torch.randn(numel).bfloat16()
    half = torch.empty(numel, dtype=torch.bfloat16)
    aio = AioHandle(block_size=1 << 20, queue_depth=32)
    rows: dict[str, list[float]] = {}
    read: dict[str, int] = {}
    with SwapStore(args.path, run_id=f"adam8bench{os.getpid()}") as store:
        tiers = {}
        for fmt in StateFormat:
            tier = NvmeStateTier([numel] * groups, store=store, aio=aio, fmt=fmt,
                                 prefetch_next_sweep=False, kind=f"optim.{fmt.value}")  # fmt: skip
            for i in range(groups):
                tier.initialize(i, torch.randn(numel))
            sweep(tier, grad, half, 1)  # warm-up; settles the initial writes
            tiers[fmt.value], rows[fmt.value] = tier, []
        for r in range(args.rounds):
            order = list(tiers) if r % 2 == 0 else list(reversed(tiers))
            for name in order:
                before = tiers[name].stats.bytes_read
                rows[name].append(sweep(tiers[name], grad, half, r + 2))
                read[name] = tiers[name].stats.bytes_read - before
        for tier in tiers.values():
            tier.close()
    med = {name: statistics.median(ts) for name, ts in rows.items()}
    return {
        "machine": machine(args.path),
        "config": {"numel": groups * numel, "sub_group": numel, "rounds": args.rounds},
        "seconds": rows,
        "median_s": med,
        "bytes_read_per_step": read,
        "ratio_8bit_to_32bit": med["adamw_8bit"] / med["adamw"],
        "loadavg": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", required=True, help="swap directory (an SSD)")
    p.add_argument("--numel", type=parse_count, default=64_000_000)
    p.add_argument("--sub-group", type=parse_count, default=8_000_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the record here")
    args = p.parse_args(argv)
    record = run(args)
    for name, t in record["median_s"].items():
        print(
            f"{name:<11} {t * 1e3:9.1f} ms  read {record['bytes_read_per_step'][name] / 1e9:.3f} GB"
        )
    print(f"8-bit / 32-bit: {record['ratio_8bit_to_32bit']:.2f}  (load {record['loadavg']})")
    if args.json:
        write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
