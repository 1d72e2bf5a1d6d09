"""Claim: the CPU-Adam step (`adam_step_flat`) runs at the memory-bandwidth limit for every
gradient dtype, and its fused half-precision copy-out beats the peers' step followed by `copy_`.

Runs `infinity bench adam` (infinity.cli.bench_adam) at each size, all peers in the same run,
and writes one JSON file with a record per size (machine info, copy bandwidth, every row).

    flock /work/bench.lock python benchmarks/adam_bench.py --numel 100M --numel 500M \\
        --json benchmarks/results/adam.json
"""

from __future__ import annotations

import argparse
import logging
import sys

from bench_record import write_json

from infinity.cli.bench_adam import PEERS, BenchConfig, format_table, parse_count, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=parse_count, action="append",
                        help="parameters per step (repeatable; default 100M and 500M)")  # fmt: skip
    parser.add_argument("--dtype", action="append", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--half-dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--peer", action="append", choices=list(PEERS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default="adam_bench.json", help="output file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    records = []
    for numel in args.numel or [100_000_000, 500_000_000]:
        cfg = BenchConfig(
            numel=numel,
            dtypes=args.dtype or ["fp32", "bf16", "fp16"],
            half_dtype=args.half_dtype,
            peers=args.peer or list(PEERS),
            warmup=args.warmup,
            repeats=args.repeats,
        )
        record = run(cfg)
        print(format_table(record), flush=True)
        records.append(record)
    write_json(records, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
