"""`infinity config FILE`: check a DeepSpeed-style config and print it as Infinity reads it."""

from __future__ import annotations

import argparse
import json
import sys

from infinity.cli.train_flags import positive_int
from infinity.config import Config, RunFacts, resolve_run
from infinity.config.resolve import check_batch, check_communication_dtype


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "config",
        help="check a DeepSpeed-style JSON config and print it with every value filled in",
        description=(
            "Load and validate a config (errors name the key path and the fix), then print "
            'it as JSON with DeepSpeed\'s key names. With --resolve, every "auto" is '
            "replaced the way training would replace it."
        ),
    )
    parser.add_argument("path", help="the JSON config file")
    parser.add_argument("--resolve", action="store_true", help='replace every "auto"')
    parser.add_argument("--world-size", type=positive_int, default=1, help="ranks (default 1)")
    parser.add_argument(
        "--hidden-size", type=positive_int, help="model hidden size, for zero sizes"
    )
    parser.add_argument("--total-steps", type=positive_int, help="optimizer steps of the run")
    parser.add_argument("--warmup-steps", type=positive_int, help="warmup optimizer steps")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = Config.load(args.path)
        # What `infinity train` would refuse is refused here too, with or without --resolve.
        check_batch(config, args.world_size)
        check_communication_dtype(config)
        if args.resolve:
            facts = RunFacts(
                world_size=args.world_size,
                hidden_size=args.hidden_size,
                total_num_steps=args.total_steps,
                warmup_num_steps=args.warmup_steps,
            )
            config = resolve_run(config, facts)
    except (TypeError, ValueError) as exc:  # TypeError: a wrong type in the file
        message = str(exc).replace(
            "pass RunFacts(total_num_steps=...) to resolve_run", "pass --total-steps N"
        )  # the same advice, in this command's terms
        if args.path not in message:
            message = f"{args.path}: {message}"
        raise ValueError(message) from None
    json.dump(config.to_dict(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
