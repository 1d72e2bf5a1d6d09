"""Entry point of the `infinity` command.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `func`, a callable taking the parsed arguments and returning an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys

from infinity import __version__

# Top-level commands, in the order `infinity --help` lists them.
COMMANDS = [
    "infinity.cli.train",
    "infinity.cli.bench",
    "infinity.cli.export",
    "infinity.cli.config_check",
    "infinity.cli.estimate",
    "infinity.cli.plot",
    "infinity.cli.generate",
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
    """Run one command; `argv` None means this process's own command line (the console
    script), which also settles what a late signal does ([Note: late signals])."""
    code = _command(argv)
    if argv is None:
        _exit_on_late_signals(code)
    return code


def _exit_on_late_signals(code: int) -> None:
    """[Note: late signals] Once the command has returned its exit code, the interpreter still
    tears down (threads, buffers). A signal then must neither kill the process with 128 + the
    signal's number (a stopped run that saved its checkpoint would look killed to a batch
    scheduler) nor be ignored (a stuck teardown could not be stopped): it ends the process
    at once with the code already decided."""

    def exit_now(signum, frame) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_now)


QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
"""Other packages' loggers that warn at import about nothing a command uses, shown with
--verbose only: transformers imports torchao wherever it is installed (the dev extra has it,
for the 8-bit comparison), and torchao then says that its CUDA kernels do not load and
registers enums in a way torch calls deprecated, five lines before every command's output."""


def _command(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, NotImplementedError, ImportError) as exc:
        # Bad input, I/O failures and a missing optional package carry their own fix in the
        # message: no traceback.
        print(f"infinity: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("infinity: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
