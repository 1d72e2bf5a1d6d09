"""`infinity train`: fine-tune or pre-train a Llama-style model with offload, from the shell.

Owns the command line: flags, how they override the JSON config, and the checks of the
inputs before any work starts. The run itself (model, data, loop, checkpoints) is in
`infinity.cli.train_run`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from infinity.config import Config
from infinity.data.source import check_data_file
from infinity.models import PRESETS


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _dropout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1)")
    return value


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no layer; e.g. q_proj,v_proj")
    return names


def lora_spec(args: argparse.Namespace):
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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a causal LM with parameters and optimizer states offloaded to RAM or NVMe",
        description=(
            "Train a Llama-style causal LM from a local Hugging Face directory (config.json + "
            "safetensors) or a preset shape with random weights, on a text or JSONL file. "
            "Flags override the JSON config. Ctrl-C or SIGTERM saves a checkpoint after the "
            "current step and exits (a second one stops at once, without saving); --resume "
            "continues from the latest checkpoint in --save-dir with the same data order, RNG, "
            "loss scale and schedule."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="DIR|PRESET",
        help=f"a Hugging Face model directory, or a preset ({', '.join(PRESETS)})",
    )
    parser.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="UTF-8 text (one document) or JSONL (.jsonl: one JSON object per line with a "
        "'text' field); tokenized with the model directory's tokenizer, else as UTF-8 bytes",
    )
    parser.add_argument(
        "--nvme",
        metavar="PATH",
        help="directory on a fast SSD for the fp32 master weights, the Adam moments and the "
        "16-bit parameters (default: host RAM, or as the config says; a config's "
        "offload_param.device 'cpu' keeps the parameters in RAM). Unless the config sets "
        "sub_group_size, it becomes 1e8 elements (4 x 1.2 GB of host buffers)",
    )
    parser.add_argument("--config", metavar="FILE", help="DeepSpeed-style JSON config")
    parser.add_argument(
        "--steps", type=_positive_int, help="optimizer steps to run (default: one epoch)"
    )
    parser.add_argument(
        "--seq-len", type=_positive_int, default=512, help="tokens per sequence (default 512)"
    )
    parser.add_argument(
        "--micro-batch", type=_positive_int, help="sequences per forward (config: 1 if unset)"
    )
    parser.add_argument(
        "--grad-accum", type=_positive_int, help="micro batches per optimizer step (config)"
    )
    parser.add_argument("--lr", type=_positive_float, help="peak learning rate (config)")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        help="training precision (config's fp16/bf16 sections; default fp32)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer's activations in backward (less memory, ~1.3x compute)",
    )
    lora = parser.add_argument_group(
        "LoRA", "train low-rank adapters (peft) on a frozen base; checkpoints hold only them"
    )
    lora.add_argument(
        "--lora-r", type=_positive_int, metavar="R", help="adapter rank (enables LoRA)"
    )
    lora.add_argument(
        "--lora-alpha",
        type=_positive_float,
        metavar="A",
        help="scale numerator: updates are B @ A * A / R (default: R, a scale of 1)",
    )
    lora.add_argument(
        "--lora-dropout",
        type=_dropout,
        default=0.0,
        metavar="P",
        help="dropout on the adapters' input, in [0, 1) (default 0)",
    )
    lora.add_argument(
        "--lora-targets",
        type=_names,
        metavar="NAMES",
        help="comma-separated linear layers to adapt, e.g. q_proj,v_proj (default: every "
        "linear layer of the blocks: q,k,v,o,gate,up,down_proj)",
    )
    parser.add_argument(
        "--save-dir",
        default="runs/infinity",
        metavar="DIR",
        help="checkpoints, metrics.jsonl and the token cache (default runs/infinity)",
    )
    parser.add_argument(
        "--save-every",
        type=_positive_int,
        metavar="N",
        help="checkpoint every N optimizer steps (default: only at the end and on a stop)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --save-dir"
    )
    parser.add_argument("--seed", type=int, help="seed for init, data order and dropout (config)")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (log lines only)"
    )
    parser.set_defaults(func=run)


# Elements per optimizer sub-group when --nvme is given and the config does not say: the NVMe
# pipeline holds buffer_count sub-groups of 12 bytes/element in RAM (4 x 1.2 GB), where
# DeepSpeed's default of 1e9 would need 48 GB.
NVME_SUB_GROUP_SIZE = 100_000_000


def config_from_args(args: argparse.Namespace) -> Config:
    """The JSON config (if any) with the flags laid over it, validated."""
    raw: dict[str, Any] = {}
    if args.config:
        from infinity.config.parse import read_json

        raw = read_json(args.config)
    base: dict[str, Any] = Config.load(raw).to_dict() if args.config else {}
    zero = base.setdefault("zero_optimization", {})
    given_zero = raw.get("zero_optimization") if isinstance(raw, dict) else None
    sub_group_given = any("sub_group_size" in k for k in (given_zero or {}))
    if args.micro_batch is not None or args.grad_accum is not None:
        base["train_batch_size"] = "auto"  # derived again from the two that were given
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
    if args.nvme is not None:
        # The optimizer states and the 16-bit parameters go to NVMe (the parameters stay in
        # RAM when the config says offload_param.device "cpu").
        nvme = os.fspath(Path(args.nvme).expanduser())
        zero.setdefault("offload_optimizer", {}).update(device="nvme", nvme_path=nvme)
        param = zero.setdefault("offload_param", {})
        param["nvme_path"] = nvme
        if not (given_zero or {}).get("offload_param", {}).get("device"):
            param["device"] = "nvme"
        if not sub_group_given:
            zero["sub_group_size"] = NVME_SUB_GROUP_SIZE
    if args.dtype is not None:
        base.setdefault("fp16", {})["enabled"] = args.dtype == "fp16"
        base.setdefault("bf16", {})["enabled"] = args.dtype == "bf16"
    if args.seed is not None:
        base["seed"] = args.seed
    return Config.load(base)


def check_inputs(args: argparse.Namespace) -> None:
    """Errors that can be known before anything is built, each with its fix."""
    model = Path(args.model).expanduser()
    if args.model not in PRESETS:
        if not model.exists():
            raise ValueError(
                f"--model {args.model}: no such directory and not a preset; give a Hugging "
                f"Face model directory (config.json + safetensors) or one of {', '.join(PRESETS)}"
            )
        if not (model / "config.json").is_file():
            raise ValueError(
                f"--model {model}: no config.json in that directory; point --model at the "
                "folder holding config.json and the *.safetensors files"
            )
    check_data_file(Path(args.data).expanduser())
    lora_spec(args)
    if args.resume:
        from infinity.checkpoint import latest_tag

        if latest_tag(args.save_dir) is None:
            raise ValueError(
                f"--resume: there is no checkpoint in {args.save_dir} (no 'latest'); "
                "run without --resume to start fresh, or point --save-dir at the earlier run"
            )


def run(args: argparse.Namespace) -> int:
    from infinity.cli.train_run import TrainRun
    from infinity.cli.train_stop import StopNow, StopSignals
    from infinity.utils.host_memory import unmap_large_allocations

    unmap_large_allocations()  # freed parameter-sized buffers leave RSS at once

    with StopSignals() as signals:
        try:
            check_inputs(args)
            run = TrainRun(args, config_from_args(args))
        except StopNow as stop:
            print(f"infinity: stopped by {stop.name} before training started", file=sys.stderr)
            return stop.exit_code
        return run.run(signals)


__all__ = ["check_inputs", "config_from_args", "lora_spec", "register", "run"]
