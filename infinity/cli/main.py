"""Entry point of the `infinity` command.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `func`, a callable taking the parsed arguments and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from infinity import __version__

# Top-level commands, in the order `infinity --help` lists them.
COMMANDS = [
    "infinity.cli.train",
    "infinity.cli.bench",
    "infinity.cli.export",
    "infinity.cli.config_check",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infinity",
        description="Train models far larger than accelerator memory, streaming from RAM and NVMe.",
    )
    parser.add_argument("--version", action="version", version=f"infinity {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, NotImplementedError, ImportError) as exc:
        # Bad input and I/O failures carry their own fix in the message: no traceback.
        print(f"infinity: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("infinity: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
