"""Claim: the order-free global norm costs what the previous per-sub-group norm cost.

The norm pass of the step (`infinity.zero.optimizer_io.scaled_norm` over a `HostGradTier`):
rows of 2048 elements measured in fp32, their squares added exactly (`ExactSum`, the same
bits on any number of ranks: [Note: the norm's order] in infinity/swap/grad_tier.py),
against the previous rule in the same run on the same gradient: rows of 4096, their squares
summed in fp64 per sub-group by torch, the sub-groups in order (its last bits depend on the
ranks and on torch's thread count). The two run alternately, in a new order each repeat.

Usage: python benchmarks/grad_norm_bench.py [--numel N] [--sub-group-size S] [--repeats R]
       [--json PATH]
Prints one JSON record (median seconds of each, their ratio and the median of the
repeats' ratios, the machine) on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
from bench_record import machine, write_json

from infinity.comm import SingleProcess
from infinity.swap.grad_tier import HostGradTier, row_norms, sum_from_norms
from infinity.utils.exact_sum import ExactSum
from infinity.zero.optimizer_io import scaled_norm

_PREVIOUS_ROW = 4096


def previous_norm(tier: HostGradTier) -> float:
    """The rule before the exact sum: per sub-group, rows of 4096 in fp32, squares summed in
    fp64 by torch; the sub-groups added in order."""
    total = 0.0
    for g in range(len(tier.numels)):
        flat = tier.take(g)
        rows = flat.numel() // _PREVIOUS_ROW * _PREVIOUS_ROW
        norms = torch.linalg.vector_norm(flat[:rows].view(-1, _PREVIOUS_ROW), dim=1)
        part = norms.double().square().sum()
        if rows < flat.numel():
            part += torch.linalg.vector_norm(flat[rows:]).double().square()
        total += float(part)
    return math.sqrt(total)


def exact_norm(tier: HostGradTier) -> float:
    return scaled_norm(tier, SingleProcess())


def _previous_rows(flat: torch.Tensor) -> torch.Tensor:
    rows = flat.numel() // _PREVIOUS_ROW * _PREVIOUS_ROW
    norms = torch.linalg.vector_norm(flat[:rows].view(-1, _PREVIOUS_ROW), dim=1)
    if rows < flat.numel():
        norms = torch.cat([norms, torch.linalg.vector_norm(flat[rows:]).reshape(1)])
    return norms


def _sums_only(tier: HostGradTier) -> dict:
    """The two rules' sums over row norms measured beforehand: the part of each pass that
    is not the pass over the gradient (which differs only in the rows' length)."""
    old = [_previous_rows(tier.take(g)) for g in range(len(tier.numels))]
    new = [row_norms(tier.take(g)) for g in range(len(tier.numels))]

    def previous(_: HostGradTier) -> float:
        return math.sqrt(sum(float(r.double().square().sum()) for r in old))

    def exact(_: HostGradTier) -> float:
        return math.sqrt(sum(map(sum_from_norms, new), ExactSum()).value())

    return {"previous_sums_only": previous, "exact_sums_only": exact}


def run(numel: int, sub_group_size: int, repeats: int) -> dict:
    sizes = [sub_group_size] * (numel // sub_group_size)
    if numel % sub_group_size:
        sizes.append(numel % sub_group_size)
    tier = HostGradTier(sizes)
    gen = torch.Generator().manual_seed(0)
    for g, n in enumerate(sizes):
        tier.add(g, 0, torch.randn(n, generator=gen) * 1e-3)
    variants = {"previous": previous_norm, "exact": exact_norm, **_sums_only(tier)}
    values = {name: fn(tier) for name, fn in variants.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats):
        for name in variants if r % 2 == 0 else reversed(list(variants)):
            start = time.perf_counter()
            variants[name](tier)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "bench": "grad_norm",
        "numel": numel,
        "sub_group_size": sub_group_size,
        "repeats": repeats,
        "median_s": median,
        "min_s": {name: min(t) for name, t in times.items()},
        "exact_over_previous": median["exact"] / median["previous"],
        # Each repeat runs both back to back: the median of their ratios is steadier on a
        # shared machine than the ratio of the medians.
        "exact_over_previous_paired": statistics.median(
            e / p for e, p in zip(times["exact"], times["previous"], strict=True)
        ),
        "gbytes_per_s": {name: 4 * numel / s / 1e9 for name, s in median.items()},
        "norms": values,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=float, default=2e8, help="gradient elements (fp32)")
    p.add_argument("--sub-group-size", type=float, default=2**25, help="elements per sub-group")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--json", default=None, help="also write the record here")
    args = p.parse_args(argv)
    record = run(int(args.numel), int(args.sub_group_size), args.repeats)
    print(json.dumps(record))
    if args.json:
        write_json(record, args.json, announce=False)
    m = record["median_s"]
    print(
        f"norm pass over {record['numel']:.3g} elements: previous {m['previous'] * 1e3:.1f} ms, "
        f"exact {m['exact'] * 1e3:.1f} ms ({record['exact_over_previous']:.3f}x, paired "
        f"{record['exact_over_previous_paired']:.3f}x); the sums alone: previous "
        f"{m['previous_sums_only'] * 1e3:.2f} ms, exact {m['exact_sums_only'] * 1e3:.2f} ms, "
        f"load {record['machine']['loadavg_1m_5m_15m']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
