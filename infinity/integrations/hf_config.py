"""The HF Trainer's arguments laid into an Infinity config, the way DeepSpeed's integration
fills a DeepSpeed config.

Owns `trainer_config(cfg, args)` and `schedule_params(...)`, and which `TrainingArguments.optim`
names the engine runs (`TRAINER_OPTIMS`): every "auto" value, and every
value the config leaves out, is taken from the `TrainingArguments`; a value given in both
places that differs is a conflict, and all conflicts are reported in one ValueError. Unlike
DeepSpeed, a left-out key is filled too (a config without `gradient_clipping` clips at the
Trainer's `max_grad_norm`), so the Trainer's arguments are what runs unless the config says
otherwise.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from infinity.config import SCHEDULER_PARAMS, Config, leave_open, left_open
from infinity.config.parse import read_json

# (config path, TrainingArguments name(s), value from the arguments)
_FROM_ARGS: list[tuple[tuple[str, ...], str, Any]] = [
    (
        ("train_micro_batch_size_per_gpu",),
        "per_device_train_batch_size",
        lambda a: a.per_device_train_batch_size,
    ),
    (
        ("gradient_accumulation_steps",),
        "gradient_accumulation_steps",
        lambda a: a.gradient_accumulation_steps,
    ),
    (
        ("train_batch_size",),
        "per_device_train_batch_size x gradient_accumulation_steps x world_size",
        lambda a: a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size,
    ),
    (("gradient_clipping",), "max_grad_norm", lambda a: float(a.max_grad_norm or 0.0)),
    (("optimizer", "params", "lr"), "learning_rate", lambda a: a.learning_rate),
    (
        ("optimizer", "params", "betas"),
        "adam_beta1, adam_beta2",
        lambda a: [a.adam_beta1, a.adam_beta2],
    ),
    (("optimizer", "params", "eps"), "adam_epsilon", lambda a: a.adam_epsilon),
    (("optimizer", "params", "weight_decay"), "weight_decay", lambda a: a.weight_decay),
    (("fp16", "enabled"), "fp16", lambda a: bool(a.fp16)),
    (("bf16", "enabled"), "bf16", lambda a: bool(a.bf16)),
]


TRAINER_OPTIMS = {
    "adamw_torch": "AdamW",
    "adamw_torch_fused": "AdamW",
    "adamw_bnb_8bit": "AdamW8bit",
    "adamw_8bit": "AdamW8bit",
    "adamw_torch_8bit": "AdamW8bit",
    "paged_adamw_32bit": "AdamW",
    "paged_adamw_8bit": "AdamW8bit",
}
"""`TrainingArguments.optim` values the engine runs, and the optimizer.type each is: AdamW
with 32-bit or with 8-bit blockwise moments (bitsandbytes' and torchao's AdamW8bit scheme;
"paged" optimizers page their state to the CPU, which the engine's tiers already do)."""


def optimizer_type(args) -> str:
    """The optimizer.type of the Trainer's `optim`; refuses one the engine does not run."""
    optim = getattr(args, "optim", "adamw_torch")
    name = str(getattr(optim, "value", optim))
    if name not in TRAINER_OPTIMS:
        raise ValueError(
            f"TrainingArguments.optim={name!r} is not an optimizer InfinityTrainer runs: the "
            f"optimizer step is the engine's CPU-Adam; use one of "
            + ", ".join(repr(n) for n in TRAINER_OPTIMS)
        )
    return TRAINER_OPTIMS[name]


_SCHEDULE_FILLS = ("total_num_steps", "warmup_num_steps", "warmup_max_lr", "warmup_min_lr")


def raw_config(cfg: Config | dict | str | os.PathLike) -> dict:
    """The config as the user wrote it: a dict, a JSON file, or a `Config` (whose values equal
    to the defaults count as not given)."""
    if isinstance(cfg, Config):
        return _prune_defaults(cfg.to_dict(), Config().to_dict())
    if isinstance(cfg, (str, os.PathLike)):
        cfg = read_json(os.fspath(cfg))
    if not isinstance(cfg, dict):
        raise TypeError(
            f"infinity_config must be a dict, a JSON file path or an infinity.Config, got "
            f"{type(cfg).__name__}"
        )
    cfg = copy.deepcopy(cfg)
    Config.load(_with_auto_schedule(cfg))  # bad keys and values fail here, named, at once
    return cfg


def _with_auto_schedule(raw: dict) -> dict:
    """`raw` with the schedule values the Trainer fills marked "auto" where left out."""
    sched = raw.get("scheduler")
    if not isinstance(sched, dict) or sched.get("type") not in SCHEDULER_PARAMS:
        return raw
    spec = SCHEDULER_PARAMS[sched["type"]]
    params = dict(sched.get("params") or {})
    for name in _SCHEDULE_FILLS:
        if name in spec:
            leave_open(params, name)
    return {**raw, "scheduler": {**sched, "params": params}}


def _prune_defaults(d: dict, default: dict) -> dict:
    out = {}
    for key, value in d.items():
        base = default.get(key)
        if isinstance(value, dict) and isinstance(base, dict):
            sub = _prune_defaults(value, base)
            if sub:
                out[key] = sub
        elif value != base:
            out[key] = value
    return out


def trainer_config(cfg: Config | dict | str | os.PathLike, args) -> dict:
    """`cfg` with the Trainer's batch sizes, accumulation, clipping, optimizer settings and
    precision filled in (see the module docstring); raises on conflicts."""
    raw = raw_config(cfg)
    raw.setdefault("optimizer", {}).setdefault("params", {})
    mismatches = []
    kind = optimizer_type(args)
    given = raw["optimizer"].get("type")
    if given is None:
        raw["optimizer"]["type"] = kind
    elif (given.lower() == "adamw8bit") != (kind == "AdamW8bit"):
        optim = getattr(args.optim, "value", args.optim)
        mismatches.append(
            f"- infinity_config optimizer.type={given!r} vs TrainingArguments optim={optim!r} "
            f"({kind})"
        )
    for path, hf_name, value_of in _FROM_ARGS:
        mismatch = _fill(raw, path, value_of(args), hf_name)
        if mismatch:
            mismatches.append(mismatch)
    _raise_on(mismatches)
    return raw


def schedule_params(raw: dict, args, num_training_steps: int) -> dict:
    """`raw` with the scheduler's "auto" or left-out run length, warmup and peak lr taken
    from the Trainer (`get_warmup_steps`, `learning_rate`), for a config that has its own
    scheduler. Without one the Trainer's `lr_scheduler_type` drives the engine instead."""
    raw = copy.deepcopy(raw)
    sched = raw.get("scheduler") or {}
    kind = sched.get("type")
    if kind not in SCHEDULER_PARAMS:
        return raw
    sched.setdefault("params", {})
    spec = SCHEDULER_PARAMS[kind]
    fills = [
        ("total_num_steps", num_training_steps, "max_steps (the run length)"),
        ("warmup_num_steps", args.get_warmup_steps(num_training_steps), "warmup_steps"),
        ("warmup_max_lr", args.learning_rate, "learning_rate"),
        ("warmup_min_lr", 0.0, "0 (the Trainer's schedules start from 0)"),
    ]
    mismatches = [
        m
        for name, value, hf_name in fills
        if name in spec and (m := _fill(raw, ("scheduler", "params", name), value, hf_name))
    ]
    _raise_on(mismatches)
    return raw


def _fill(raw: dict, path: tuple[str, ...], value: Any, hf_name: str) -> str | None:
    node = raw
    for key in path[:-1]:
        node = node.setdefault(key, {})
    key = path[-1]
    if left_open(node, key):
        node[key] = value
        return None
    given = node[key]
    if _same(given, value):
        return None
    return f"- infinity_config {'.'.join(path)}={given!r} vs TrainingArguments {hf_name}={value!r}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _raise_on(mismatches: list[str]) -> None:
    if mismatches:
        raise ValueError(
            "these infinity_config values disagree with the TrainingArguments:\n"
            + "\n".join(mismatches)
            + '\nset them to "auto" (or leave them out) to take the Trainer\'s values, or '
            "change the TrainingArguments to match"
        )
