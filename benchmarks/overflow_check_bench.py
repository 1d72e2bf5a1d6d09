"""Claim: `has_overflow` checks gradients for inf/NaN at memory speed, exactly, in every dtype.

Peers, measured in the same run on the same tensors:
- `sum_per_tensor`: DeepSpeed's rule, `float(t.float().sum())` per tensor (one host sync per
  tensor, a full fp32 copy for half-precision tensors, and a false positive when finite values
  sum past the fp32 range);
- `isfinite_all`: `torch.stack([t.isfinite().all() for t in ts]).all()` (exact, one sync, but
  writes a bool mask per tensor);
- `aminmax`: `isfinite` of every tensor's min and max (exact, one sync);
- `foreach_norm`: `isfinite` of `torch._foreach_norm` (one sync; inexact like the sum, and a
  half-precision norm overflows at 65504).

Usage: python benchmarks/overflow_check_bench.py [--numel N] [--tensors K] [--repeats R]
Prints one JSON record per (dtype, method) and a summary table on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from bench_record import machine

from infinity.optim.loss_scaler import has_overflow


def sum_per_tensor(tensors) -> bool:
    for t in tensors:
        total = float(t.float().sum())
        if total != total or total in (float("inf"), float("-inf")):
            return True
    return False


def isfinite_all(tensors) -> bool:
    return not bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def aminmax(tensors) -> bool:
    extremes = [torch.stack(torch.aminmax(t)) for t in tensors]
    return not bool(torch.isfinite(torch.stack(extremes)).all())


def foreach_norm(tensors) -> bool:
    return not bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all())


METHODS = {
    "has_overflow": has_overflow,
    "sum_per_tensor": sum_per_tensor,
    "isfinite_all": isfinite_all,
    "aminmax": aminmax,
    "foreach_norm": foreach_norm,
}


def run(numel: int, tensors: int, repeats: int, warmup: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(max(1, numel // tensors), generator=gen) for _ in range(tensors)]
    records = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        data = [t.to(dtype) for t in base]
        for name, fn in METHODS.items():
            assert fn(data) is False, name  # all finite: every method must agree
            for _ in range(warmup):
                fn(data)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn(data)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            nbytes = sum(t.numel() * t.element_size() for t in data)
            records.append(
                {
                    "bench": "overflow_check",
                    "method": name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "numel": sum(t.numel() for t in data),
                    "tensors": len(data),
                    "repeats": repeats,
                    "median_s": median,
                    "read_gb_per_s": nbytes / median / 1e9,
                    "machine": machine(),
                }
            )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=50_000_000, help="elements in all tensors")
    parser.add_argument("--tensors", type=int, default=64, help="number of tensors")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    records = run(args.numel, args.tensors, args.repeats, args.warmup)
    for record in records:
        print(json.dumps(record))
    for r in records:
        print(
            f"{r['dtype']:>8} {r['method']:>15} {r['median_s'] * 1e3:9.2f} ms "
            f"{r['read_gb_per_s']:7.1f} GB/s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
