"""Claim: with the optimizer state split between RAM and NVMe (`offload_optimizer.max_in_cpu`),
a sweep that steps the RAM sub-groups between the NVMe ones (the default order,
`interleaved_order`) costs the slower of CPU-Adam and the disk, as the estimate counts it,
where stepping every RAM sub-group first costs the RAM part's CPU-Adam plus the NVMe part.

One `SplitStateTier` (--ram-gib of state in RAM, --nvme-gib on NVMe); each round sweeps it
once in each order with a real CPU-Adam step per sub-group, the order of the two alternating
so the shared disk's swings hit both alike. Reading into the next sweep is off (nothing runs
between the sweeps here to hide it). Reported beside the medians: CPU-Adam alone over every
sub-group and the NVMe part's transfers alone (a sweep of the NVMe tier without Adam), so
max(Adam, disk) and Adam of the RAM part + the NVMe part's sweep can be read against them.

    python -m benchmarks.split_sweep_bench --path /tmp/split --rounds 5 \\
        --json benchmarks/results/split_sweep.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from bench_record import machine, write_json

from benchmarks.optimizer_swap_bench import open_aio
from infinity.optim import adam_step_flat
from infinity.swap.nvme_state import NvmeStateTier
from infinity.swap.split_state import SplitStateTier, interleaved_order
from infinity.swap.store import SwapStore


def _sweep(tier, grad: torch.Tensor, step: int, order=None, adam: bool = True) -> float:
    """Seconds for one sweep in `order` (None: the tier's default), stepping each sub-group."""
    start = time.perf_counter()
    for _, s in tier.sweep(order):
        if adam:
            adam_step_flat(s.master, grad, s.exp_avg, s.exp_avg_sq, step=step, lr=1e-3)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict:
    numel = args.sub_group_numel
    in_ram = max(1, round(args.ram_gib * (1 << 30) / (12 * numel)))
    on_disk = max(1, round(args.nvme_gib * (1 << 30) / (12 * numel)))
    count = in_ram + on_disk
    g = torch.Generator().manual_seed(0)
    grad, master = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    rows: dict[str, list[float]] = {"interleaved": [], "ram_first": [], "nvme_alone": []}
    os.makedirs(args.path, exist_ok=True)
    with open_aio(args) as aio, SwapStore(args.path, run_id=f"split{os.getpid()}") as store:

        def make_nvme(numels: list[int]) -> NvmeStateTier:
            return NvmeStateTier(numels, store=store, aio=aio, buffer_count=args.buffer_count,
                                 prefetch_next_sweep=False, kind="optim")  # fmt: skip

        tier = SplitStateTier([numel] * count, in_ram, make_nvme)
        for i in range(count):
            tier.initialize(i, master)
        _sweep(tier, grad, step=1)  # warm-up; settles the initial writes
        orders = {"interleaved": None, "ram_first": list(range(count))}
        step = 2
        for r in range(args.rounds):
            names = ["interleaved", "ram_first"][:: 1 if r % 2 == 0 else -1]
            for name in names:
                rows[name].append(_sweep(tier, grad, step, orders[name]))
                step += 1
            rows["nvme_alone"].append(_sweep(tier.nvme, grad, step, adam=False))
        adam = []
        for _ in range(3):
            s = tier.host.resident(0)
            start = time.perf_counter()
            adam_step_flat(s.master, grad, s.exp_avg, s.exp_avg_sq, step=step, lr=1e-3)
            adam.append(time.perf_counter() - start)
            step += 1
        tier.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    adam_all = statistics.median(adam) * count
    adam_ram = statistics.median(adam) * in_ram
    return {
        "bench": "split_sweep",
        "sub_group_numel": numel,
        "sub_groups_in_ram": in_ram,
        "sub_groups_on_nvme": on_disk,
        "order": interleaved_order(in_ram, count),
        "rounds": args.rounds,
        "sweep_s": rows,
        "median_s": med,
        "adam_s_all": adam_all,
        "model_interleaved_s": max(adam_all, med["nvme_alone"]),
        "model_ram_first_s": adam_ram + max(adam_all - adam_ram, med["nvme_alone"]),
        "interleaved_vs_ram_first": med["interleaved"] / med["ram_first"],
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default="/tmp/split_sweep", help="directory on the disk")
    p.add_argument("--ram-gib", type=float, default=1.0, help="fp32 state kept in RAM")
    p.add_argument("--nvme-gib", type=float, default=0.5, help="fp32 state on NVMe")
    p.add_argument("--sub-group-numel", type=int, default=4 << 20)
    p.add_argument("--buffer-count", type=int, default=3)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="split_sweep.json", help="output file")
    args = p.parse_args(argv)
    result = run(args)
    write_json(result, args.json)
    med = result["median_s"]
    print(
        f"interleaved {med['interleaved']:.3f} s, RAM first {med['ram_first']:.3f} s "
        f"({result['interleaved_vs_ram_first']:.2f}x); CPU-Adam {result['adam_s_all']:.3f} s, "
        f"NVMe part alone {med['nvme_alone']:.3f} s; model: {result['model_interleaved_s']:.3f}"
        f" / {result['model_ram_first_s']:.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
