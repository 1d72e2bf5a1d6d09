"""Claim: PartitionedOptimizer's whole step (grad norm, clipping, CPU-Adam over the sub-groups,
new weights into the homes, zeroing the gradients) costs about what
`torch.optim.AdamW(fused=True)` costs for the step alone, and much less than AdamW(foreach).

Parameters are split into GPT-like slots (4x768x768, 2x768x3072, 2x768 repeated) up to
--numel. The peers step the same parameters with `clip_grad_norm_(foreach=True)` first when
--clip > 0. Candidates run round-robin (one call of each per round) so load from other
processes falls on every one alike; gradients are refilled before each call, untimed.

    flock /work/bench.lock python benchmarks/zero_optimizer_bench.py --numel 100M \\
        --json benchmarks/results/zero_optimizer.json
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from bench_record import machine, write_json

from infinity.cli.bench_adam import parse_count
from infinity.config import OptimizerConfig, ZeroConfig
from infinity.zero import PartitionedOptimizer, Slot

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LAYER = [768 * 768] * 4 + [768 * 3072] * 2 + [768] * 2


def slot_numels(total: int) -> list[int]:
    """GPT-like parameter sizes, repeated until `total` elements (the last one trimmed)."""
    numels, left = [], total
    while left > 0:
        for n in LAYER:
            if left <= 0:
                break
            numels.append(min(n, left))
            left -= numels[-1]
    return numels


class Ours:
    """PartitionedOptimizer on the host tier; the step call includes everything it does."""

    def __init__(self, numels, src, dtype, sub_group_size, clip):
        slots, start = [], 0
        for i, n in enumerate(numels):
            slots.append(Slot(f"p{i}", n, torch.randn(n).to(dtype)))
            start += n
        optimizer = OptimizerConfig(type="AdamW", betas=HYPER["betas"], eps=HYPER["eps"],
                                    weight_decay=HYPER["weight_decay"])  # fmt: skip
        zero = ZeroConfig(sub_group_size=sub_group_size)
        self.opt = PartitionedOptimizer(slots, optimizer=optimizer, zero=zero)
        self.src, self.clip, self.numels = src, clip, numels
        self.breakdown: list[dict] = []

    def setup(self) -> None:
        start = 0
        for i, n in enumerate(self.numels):
            self.opt.grad(i).copy_(self.src[start : start + n])
            start += n

    def __call__(self) -> None:
        result = self.opt.step(lr=HYPER["lr"], max_grad_norm=self.clip)
        assert not result.overflow
        self.breakdown.append(dict(self.opt.last_timings))


class TorchPeer:
    """torch.optim.AdamW over per-slot fp32 parameters; gradients are views of one buffer."""

    def __init__(self, numels, src, grad_flat, clip, **impl):
        self.params = [torch.randn(n).requires_grad_() for n in numels]
        start = 0
        for p, n in zip(self.params, numels, strict=True):
            p.grad = grad_flat[start : start + n]
            start += n
        self.opt = torch.optim.AdamW(self.params, **HYPER, **impl)
        self.src, self.grad_flat, self.clip = src, grad_flat, clip

    def setup(self) -> None:
        self.grad_flat.copy_(self.src)

    def __call__(self) -> None:
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.opt.step()


def run_round_robin(cands: dict[str, object], warmup: int, repeats: int) -> dict[str, list]:
    times: dict[str, list[float]] = {name: [] for name in cands}
    for r in range(warmup + repeats):
        for name, cand in cands.items():
            cand.setup()
            t0 = time.perf_counter()
            cand()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def bench(args) -> dict:
    load_before = list(os.getloadavg())  # torch's many small parallel regions suffer most
    numels = slot_numels(args.numel)
    src = torch.randn(args.numel)
    cands: dict[str, Callable] = {}
    for d in args.dtype:
        cands[f"infinity-{d}"] = Ours(numels, src, DTYPES[d], args.sub_group_size, args.clip)
    grad_flat = torch.empty(args.numel)  # shared by the peers, refilled before each call
    if "torch-fused" in args.peer:
        cands["torch-fused"] = TorchPeer(numels, src, grad_flat, args.clip, fused=True)
    if "torch-foreach" in args.peer:
        cands["torch-foreach"] = TorchPeer(numels, src, grad_flat, args.clip, foreach=True)
    times = run_round_robin(cands, args.warmup, args.repeats)
    results = {}
    for name, ts in times.items():
        results[name] = {"median_s": statistics.median(ts), "min_s": min(ts), "times_s": ts}
        cand = cands[name]
        if isinstance(cand, Ours):
            skip = args.warmup
            results[name]["breakdown_median_s"] = {
                k: statistics.median(b[k] for b in cand.breakdown[skip:]) for k in cand.breakdown[0]
            }
            results[name]["memory"] = cand.opt.memory_stats()
    for name in results:
        for peer in ("torch-fused", "torch-foreach"):
            if peer in results and name.startswith("infinity"):
                ratio = results[name]["median_s"] / results[peer]["median_s"]
                results[name][f"ratio_to_{peer}"] = ratio
    return {
        "benchmark": "zero_optimizer_step",
        "numel": args.numel,
        "slots": len(numels),
        "sub_group_size": args.sub_group_size,
        "clip": args.clip,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "machine": machine(),
        "loadavg_before_1m_5m_15m": load_before,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=parse_count, default=100_000_000)
    parser.add_argument("--dtype", action="append", choices=list(DTYPES),
                        help="our model dtypes (repeatable; default fp32)")  # fmt: skip
    parser.add_argument("--peer", action="append", choices=["torch-fused", "torch-foreach"])
    parser.add_argument("--sub-group-size", type=parse_count, default=1_000_000_000)
    parser.add_argument("--clip", type=float, default=1.0, help="max grad norm (0: no clip)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default="zero_optimizer_bench.json", help="output file")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ["fp32"]
    args.peer = args.peer or ["torch-fused", "torch-foreach"]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    record = bench(args)
    for name, r in record["results"].items():
        ratios = " ".join(f"{k}={v:.2f}" for k, v in r.items() if k.startswith("ratio"))
        print(f"{name:16s} median {r['median_s'] * 1e3:8.1f} ms  {ratios}", flush=True)
        if "breakdown_median_s" in r:
            parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["breakdown_median_s"].items())
            print(f"{'':16s} ({parts})", flush=True)
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
