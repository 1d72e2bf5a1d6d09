"""Claim: the I/O engine's throughput across backends, block sizes, queue depths and threads
on one disk (the sweep of `infinity bench aio`), writes over a laid-out file and O_DIRECT
reads, with the first writes into a fresh file timed apart.

    flock /work/bench.lock python benchmarks/aio_bench.py --path /mnt/ssd --size 2G \\
        --backend all --json benchmarks/results/aio_bench.json
"""

from __future__ import annotations

import argparse
import sys

from bench_record import write_json

from infinity.cli.bench_aio import add_arguments, config_from_args, format_table, json_records, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(json="aio_bench.json")
    args = parser.parse_args(argv)
    result = run(config_from_args(args))
    print(format_table(result), flush=True)
    write_json(json_records(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
