"""What the schedule and optimizer flags of `infinity train` mean: --lr-schedule,
--warmup-steps, --warmup-ratio, --min-lr, --weight-decay, --optim and --convert-optim-state
laid over the config's scheduler and optimizer sections.

Owns that mapping and its conflicts (a flag and the config file that set the same thing
differently are one error naming both); the schedules themselves are
`infinity.optim.schedules`' ([Note: transformers-style step indexing] there).
"""

from __future__ import annotations

import argparse
from typing import Any

from infinity.config import OptimizerConfig, leave_open, left_open

OPTIM_TYPES = {"adamw": "AdamW", "adamw_8bit": "AdamW8bit"}
"""`--optim` names and the optimizer.type each selects (docs/optimizer_8bit.md)."""


def add_optim_flag(parser: Any) -> None:
    """--optim, shared by `infinity train` and `infinity estimate`."""
    parser.add_argument(
        "--optim",
        choices=list(OPTIM_TYPES),
        help="adamw: 32-bit moments (12 bytes of state per parameter); adamw_8bit: 8-bit "
        "blockwise moments (about 6) (config: optimizer.type AdamW / AdamW8bit)",
    )


def schedule_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The schedule flags that were given, by their command-line names."""
    given = {
        "--lr-schedule": getattr(args, "lr_schedule", None),
        "--warmup-steps": getattr(args, "warmup_steps", None),
        "--warmup-ratio": getattr(args, "warmup_ratio", None),
        "--min-lr": getattr(args, "min_lr", None),
    }
    return {flag: value for flag, value in given.items() if value is not None}


def apply_schedule_flags(args: argparse.Namespace, raw: dict, base: dict) -> None:
    """Lay the flags over `base` (the loaded config as a dict); `raw` is the config file's
    own JSON, for the conflicts. Raises ValueError naming the flag and the config key."""
    where = f"the config file {args.config}" if getattr(args, "config", None) else "the config"
    _apply_weight_decay(args, raw, base, where)
    apply_optim_flags(args, raw, base, where)
    flags = schedule_flags(args)
    if not flags:
        return
    shown = " ".join(f"{flag} {value}" for flag, value in flags.items())
    sched = raw.get("scheduler") if isinstance(raw, dict) else None
    if isinstance(sched, dict) and sched.get("type") is not None:
        raise ValueError(
            f"{shown} and scheduler.type {sched['type']!r} in {where} both set the learning-rate "
            "schedule; drop the flags or the config's scheduler section"
        )
    kind = flags.get("--lr-schedule", "constant")
    if "--min-lr" in flags and kind == "constant":
        raise ValueError(
            f"--min-lr {flags['--min-lr']} is where a decay ends, and the schedule is constant; "
            "add --lr-schedule linear or --lr-schedule cosine, or drop --min-lr"
        )
    _check_min_lr(flags.get("--min-lr"), base)
    warmup = flags.get("--warmup-steps")
    steps = getattr(args, "steps", None)
    if warmup is not None and steps is not None and warmup > steps:
        raise ValueError(
            f"--warmup-steps {warmup} is more than --steps {steps}: the run would end inside "
            f"its warmup; give --warmup-steps {steps} or less (or --warmup-ratio)"
        )
    params: dict[str, Any] = {}
    leave_open(params, "total_num_steps")  # the run's length, known with the data
    if warmup is not None:
        params["warmup_num_steps"] = warmup
    if "--warmup-ratio" in flags:
        params["warmup_ratio"] = flags["--warmup-ratio"]
    if "--min-lr" in flags:
        params["min_lr"] = flags["--min-lr"]
    base["scheduler"] = {"type": kind, "params": params}


def _check_min_lr(min_lr: float | None, base: dict) -> None:
    params = (base.get("optimizer") or {}).get("params") or {}
    lr = OptimizerConfig().lr if left_open(params, "lr") else float(params["lr"])
    if min_lr is not None and min_lr > lr:
        raise ValueError(
            f"--min-lr {min_lr} is above the lr ({lr}, --lr or the config): the schedule "
            "decays from the lr down to --min-lr; lower --min-lr or raise --lr"
        )


def apply_optim_flags(args: argparse.Namespace, raw: dict, base: dict, where: str) -> None:
    """--optim and --convert-optim-state over the optimizer section; --optim and a config
    type that says otherwise are one error naming both."""
    optim = getattr(args, "optim", None)
    section = base.setdefault("optimizer", {"type": "AdamW"})
    if getattr(args, "convert_optim_state", None):
        section.setdefault("params", {})["convert_state"] = True
    if optim is None:
        return
    given = (raw.get("optimizer") or {}).get("type") if isinstance(raw, dict) else None
    wanted = OPTIM_TYPES[optim]
    same = given is None or str(given).lower() == wanted.lower()
    if not same and not (optim == "adamw" and str(given).lower() == "adam"):
        raise ValueError(
            f"--optim {optim} and optimizer.type {given!r} in {where} differ; drop one of them"
        )
    if given is None or same:
        section["type"] = wanted


def _apply_weight_decay(args: argparse.Namespace, raw: dict, base: dict, where: str) -> None:
    decay = getattr(args, "weight_decay", None)
    if decay is None:
        return
    params = (raw.get("optimizer") or {}).get("params") or {}
    given = params.get("weight_decay")
    if not left_open(params, "weight_decay") and float(given) != decay:
        raise ValueError(
            f"--weight-decay {decay} and optimizer.params.weight_decay {given} in {where} "
            "differ; drop one of them"
        )
    base.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})["weight_decay"] = decay
