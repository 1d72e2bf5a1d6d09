"""`infinity bench ...`: measure what this machine gives before training on it."""

from __future__ import annotations

import argparse
import importlib

# Benchmarks under `infinity bench`, each a module with `register(subparsers)`.
BENCHES: list[str] = ["infinity.cli.bench_aio", "infinity.cli.bench_adam"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="measure NVMe swap and CPU-Adam throughput")
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for name in BENCHES:
        importlib.import_module(name).register(sub)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
