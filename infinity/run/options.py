"""How `infinity train`'s flags override its JSON config, and the checks of the result.

Owns `RunOptions`, the run's options as one typed value (the flags, or built from Python),
and `config_from_args` (used by `train` and `estimate`): the config file read and checked
with --nvme as its missing nvme_path, the flags laid over it, a config's global batch kept
when one of --micro-batch and --grad-accum is given, and the batch triple checked for the
run's ranks before any data is read.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from infinity.config import Config, left_open
from infinity.config.resolve import check_batch, check_communication_dtype
from infinity.run.schedule import apply_schedule_flags

log = logging.getLogger(__name__)


# Elements per optimizer sub-group when --nvme is given and the config does not say: the NVMe
# pipeline holds buffer_count sub-groups of 12 bytes/element in RAM (4 x 240 MB), where
# DeepSpeed's default of 1e9 would need 48 GB. Small enough that a 4 GiB --ram-budget runs a
# 2B model (the buffers are RAM the planner cannot give to state), large enough that each I/O
# runs at the disk's rate; one size for every budget, so every placement sums the gradient
# norm in the same order and trains to the same bits.
NVME_SUB_GROUP_SIZE = 20_000_000


def read_config_file(args: argparse.Namespace) -> dict[str, Any]:
    """The --config file as the user wrote it ({} without one), read once for the run: the
    config is built from it, and its keys say what the user set (which the placement planner
    leaves alone: `infinity.run.placement`)."""
    if not args.config:
        return {}
    from infinity.config.parse import read_json

    raw = read_json(args.config)
    if not isinstance(raw, dict):
        raise ValueError(
            f"config file {args.config!r} holds a JSON {type(raw).__name__}; a config is "
            'one JSON object such as {"train_micro_batch_size_per_gpu": 1}'
        )
    return raw


def config_from_args(
    args: argparse.Namespace, world_size: int = 1, *, raw: dict[str, Any] | None = None
) -> Config:
    """The JSON config (if any) with the flags laid over it, validated; its batch triple
    checked for `world_size` ranks (train_batch_size counts all of them). `raw`: the config
    file as `read_config_file` read it (read here when not given)."""
    raw = read_config_file(args) if raw is None else raw
    nvme = _nvme_paths(args.nvme)
    if nvme is not None:
        raw = _with_nvme_path(raw, nvme)
    try:
        base: dict[str, Any] = Config.load(raw).to_dict() if args.config else {}
    except (TypeError, ValueError) as exc:  # TypeError: a value of the wrong type
        raise ValueError(f"config file {args.config!r}: {exc}") from None
    zero = base.setdefault("zero_optimization", {})
    given_zero = raw.get("zero_optimization") if isinstance(raw, dict) else None
    sub_group_given = any("sub_group_size" in k for k in (given_zero or {}))
    if args.micro_batch is not None or args.grad_accum is not None:
        _keep_global_batch(args, raw, base, world_size)
        base.pop("train_batch_size", None)  # left out: derived again from the two given
    if args.micro_batch is not None:
        base["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.grad_accum is not None:
        base["gradient_accumulation_steps"] = args.grad_accum
    if args.lr is not None:
        base.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})["lr"] = args.lr
        sched = base.get("scheduler") or {}
        params = sched.get("params") or {}
        if "warmup_max_lr" in params:
            params["warmup_max_lr"] = args.lr
    if nvme is not None:
        # The optimizer states and the 16-bit parameters go to NVMe (the parameters stay in
        # RAM when the config says offload_param.device "cpu", and on the device at ZeRO
        # stages 0-2).
        zero.setdefault("offload_optimizer", {}).update(device="nvme", nvme_path=nvme)
        param = zero.setdefault("offload_param", {})
        param["nvme_path"] = nvme
        given = given_zero or {}
        if not given.get("offload_param", {}).get("device") and given.get("stage", 3) == 3:
            param["device"] = "nvme"
        if not sub_group_given:
            zero["sub_group_size"] = NVME_SUB_GROUP_SIZE
    if args.dtype is not None:
        base.setdefault("fp16", {})["enabled"] = args.dtype == "fp16"
        base.setdefault("bf16", {})["enabled"] = args.dtype == "bf16"
    if args.seed is not None:
        base["seed"] = args.seed
    apply_schedule_flags(args, raw, base)
    config = Config.load(base)
    if args.seed is None:
        check_seed(config.seed, f"the seed in {args.config}")
    # The batch triple is checked now, not after the data is tokenized; the communication
    # dtype against the precision the flags set.
    check_batch(config, world_size)
    check_communication_dtype(config)
    return config


def _nvme_paths(flag: str | None) -> str | list[str] | None:
    """--nvme as the config's nvme_path: one directory, or a list of one per local rank."""
    if flag is None:
        return None
    paths = [os.fspath(Path(p.strip()).expanduser()) for p in flag.split(",")]
    return paths if len(paths) > 1 else paths[0]


def _with_nvme_path(raw: dict, nvme: str | list[str]) -> dict:
    """`raw` with --nvme as the nvme_path of each offload section that names the device
    "nvme" without a path (the config is checked with it, not refused for lacking one)."""
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict):
        return raw
    zero = dict(zero)
    for name in ("offload_optimizer", "offload_param"):
        section = zero.get(name)
        if isinstance(section, dict) and section.get("device") == "nvme":
            zero[name] = {"nvme_path": nvme, **section}
    return {**raw, "zero_optimization": zero}


def _keep_global_batch(args: argparse.Namespace, raw: dict, base: dict, world: int) -> None:
    """One of --micro-batch and --grad-accum with a config's train_batch_size: the config's
    global batch stays and the other factor is derived from it (both flags: they win)."""
    if left_open(raw, "train_batch_size") or (
        args.micro_batch is not None and args.grad_accum is not None
    ):
        return
    train = raw["train_batch_size"]
    flag, given, other = (
        ("--micro-batch", args.micro_batch, "gradient_accumulation_steps")
        if args.micro_batch is not None
        else ("--grad-accum", args.grad_accum, "train_micro_batch_size_per_gpu")
    )
    if not isinstance(train, int) or train % (given * world):
        raise ValueError(
            f"{flag} {given} with the train_batch_size {train!r} of {args.config}: that "
            f"global batch is not {flag} x {other} x {world} rank(s) for any whole {other}; "
            f"give a {flag} that divides it, or both --micro-batch and --grad-accum (which "
            "replace train_batch_size)"
        )
    base[other] = train // (given * world)
    log.info("%s %d with train_batch_size %d from %s: %s %d", flag, given, train,
             args.config, other, base[other])  # fmt: skip


# torch.manual_seed takes up to 2**64 - 1, and the data order's PCG64 needs a non-negative seed.
SEED_MAX = 2**64 - 1


def check_seed(seed: int, where: str = "--seed") -> None:
    """Refuse a seed torch or the data order cannot take, naming it and where it came from."""
    if isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
        raise ValueError(
            f"{where} is {seed}, out of range: give a whole number from 0 to 2**64 - 1 ({SEED_MAX})"
        )


def lora_spec(args: RunOptions):
    """The run's LoRA adapters, or None without --lora-r (the other LoRA flags need it)."""
    from infinity.models.lora import LoraSpec

    if args.lora_r is None:
        given = [
            flag
            for flag, value in (
                ("--lora-alpha", args.lora_alpha),
                ("--lora-targets", args.lora_targets),
            )
            if value is not None
        ] + (["--lora-dropout"] if args.lora_dropout else [])
        if given:
            raise ValueError(
                f"{', '.join(given)} need --lora-r R (the adapter rank) to enable LoRA"
            )
        return None
    return LoraSpec(
        r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, targets=args.lora_targets
    )


def example_options(args: RunOptions):
    """The run's `ExampleOptions` from the instruction-data flags."""
    from infinity.data import ExampleOptions

    return ExampleOptions(
        chat_template=args.chat_template,
        train_on_prompt=args.train_on_prompt,
        pack=args.pack,
        overlong=args.overlong,
    )


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What one training run is asked to do: `infinity train`'s flags as one typed value.

    The command line builds it from its flags (`from_args`); a Python caller builds it
    directly, `RunOptions(model="tiny", data="train.jsonl", steps=2)`, and hands it to
    `infinity.run.launch.train` or `TrainRun`. Each field is the flag of the same name
    (`--save-dir` is `save_dir`) with the flag's default, so both ways mean the same run;
    the JSON config the flags override stays in `config` (a path), laid under them by
    `config_from_args`. Built directly, the values the flags' parsers would refuse are
    refused here, naming the option (`__post_init__`).
    """

    model: str
    """A Hugging Face model directory (config.json + safetensors) or a preset name."""
    data: str | None = None
    """The training text or JSONL file; None: the sample corpus shipped in the package."""
    data_field: str = "text"
    chat_template: str | None = None
    train_on_prompt: bool = False
    pack: bool = False
    overlong: str = "truncate"
    tokenizer: str | None = None
    byte_tokens: bool = False
    nvme: str | None = None
    """One NVMe directory, or a comma-separated list of one per local rank."""
    config: str | None = None
    """The DeepSpeed-style JSON config file the other options override."""
    steps: int | None = None
    seq_len: int = 512
    micro_batch: int | None = None
    grad_accum: int | None = None
    lr: float | None = None
    dtype: str | None = None
    activation_checkpointing: bool = False
    lr_schedule: str | None = None
    warmup_steps: int | None = None
    warmup_ratio: float | None = None
    min_lr: float | None = None
    weight_decay: float | None = None
    optim: str | None = None
    convert_optim_state: bool | None = None
    eval_data: str | None = None
    eval_every: int | None = None
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | None = None
    save_dir: str = "runs/infinity"
    save_every: int | None = None
    resume: bool = False
    overwrite: bool = False
    keep_last: int | None = None
    seed: int | None = None
    no_progress: bool = False
    comm_timeout: float | None = None
    profile: int | None = None
    report_to: str = "none"
    accept_unverified_checkpoint: bool = False
    ram_budget: int | None = None
    """Bytes (the flag's size, parsed)."""
    device_memory: int | None = None
    placement: str = "auto"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        """The options of `infinity train`'s parsed flags (each field from its flag)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def __post_init__(self) -> None:
        for name, choices in OPTION_CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(
                    f"RunOptions {name}={value!r}: not one of {', '.join(map(repr, choices))} "
                    f"(--{name.replace('_', '-')}); give one of those"
                )
        for name in POSITIVE_OPTIONS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(
                    f"RunOptions {name}={value!r}: must be a positive number "
                    f"(--{name.replace('_', '-')}); give one above 0, or None for the default"
                )


# The values `infinity train`'s flags accept, as their parsers check them
# (tests/test_run_library.py holds the two to the same lists).
OPTION_CHOICES: dict[str, tuple[str, ...]] = {
    "overlong": ("truncate", "drop"),
    "dtype": ("fp32", "bf16", "fp16"),
    "lr_schedule": ("constant", "linear", "cosine"),
    "optim": ("adamw", "adamw_8bit"),
    "report_to": ("none", "tensorboard"),
    "placement": ("auto", "nvme"),
}
POSITIVE_OPTIONS = (
    "steps", "seq_len", "micro_batch", "grad_accum", "lr", "eval_every", "lora_r",
    "lora_alpha", "save_every", "keep_last", "comm_timeout", "profile",
)  # fmt: skip
