"""`infinity train`: fine-tune or pre-train a causal LM with offload, from the shell.

Owns the command line: flags, how they override the JSON config, and the checks of the
inputs before any work starts. The run itself (model, data, loop, checkpoints) is in
`infinity.cli.train_run`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infinity.config import Config
from infinity.config.resolve import check_batch
from infinity.data.source import check_data_file
from infinity.data.tokenizer import TOKENIZER_FILES, require_transformers, tokenizer_files
from infinity.models import PRESETS

if TYPE_CHECKING:
    from infinity.models.hf_auto import CausalLMSpec


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


positive_int = _positive_int  # the other commands' counts are checked the same way


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number and positive")
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
            "Train a causal LM from a local Hugging Face directory (config.json + safetensors; "
            "the model is its own transformers class: Llama, Qwen2, Mistral, Gemma, Phi-3, "
            "GPT-2, ...) or a Llama preset shape with random weights, on a text or JSONL file. "
            "Flags override the JSON config. Ctrl-C, SIGTERM or SIGHUP saves a checkpoint after "
            "the current step and exits (a second one stops at once, without saving); --resume "
            "continues from the newest checkpoint in --save-dir with the same data order, RNG, "
            "loss scale and schedule. One run at a time holds --save-dir; a new run refuses one "
            "that holds checkpoints unless --overwrite is given."
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
        help="UTF-8 text (one document) or JSONL (.jsonl: one JSON object per line, the text "
        "in the field --data-field names); tokenized with the model directory's tokenizer",
    )
    parser.add_argument(
        "--data-field",
        default="text",
        metavar="NAME",
        help="the JSONL field that holds each document's text (default 'text')",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a directory holding a Hugging Face tokenizer (any form transformers reads) to use "
        "instead of the model directory's; needed with a preset unless --byte-tokens is given",
    )
    parser.add_argument(
        "--byte-tokens",
        action="store_true",
        help="tokenize the data as UTF-8 bytes (ids 0-255, BOS 256, EOS 257) instead of with "
        "a tokenizer; the model needs a vocab_size of at least 258",
    )
    parser.add_argument(
        "--nvme",
        metavar="PATH[,PATH...]",
        help="directory on a fast SSD for the fp32 master weights, the Adam moments and the "
        "16-bit parameters (default: host RAM, or as the config says; a config's "
        "offload_param.device 'cpu' keeps the parameters in RAM); under torchrun, one "
        "directory shared by the ranks or a comma-separated list of one per local rank. "
        "Unless the config sets sub_group_size, it becomes 1e8 elements (4 x 1.2 GB of host "
        "buffers)",
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
        help="recompute each layer's activations in backward (less memory, ~1.3x compute), "
        "through the model's own activation checkpointing",
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
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --save-dir whose checksums verify, with "
        "the same model, precision, sequence length, seed and sequences per step",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a --save-dir that holds checkpoints: delete them and metrics.jsonl "
        "first (without it, such a directory is refused unless --resume is given)",
    )
    parser.add_argument(
        "--keep-last",
        type=_positive_int,
        metavar="N",
        help="after each save keep only the N newest checkpoints (default: keep all); the one "
        "'latest' names is never removed",
    )
    parser.add_argument("--seed", type=int, help="seed for init, data order and dropout (config)")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (log lines only)"
    )
    parser.add_argument(
        "--comm-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="under torchrun: how long a rank waits for the others in one collective before "
        "the run stops with an error naming the rank (default: $INFINITY_COMM_TIMEOUT_S, else "
        "600)",
    )
    parser.add_argument(
        "--profile",
        type=_positive_int,
        metavar="STEPS",
        help="record STEPS optimizer steps after one warm-up step with torch.profiler and "
        "write a Chrome trace (chrome://tracing, Perfetto) to SAVE_DIR/profile/",
    )
    parser.set_defaults(func=run)


# Elements per optimizer sub-group when --nvme is given and the config does not say: the NVMe
# pipeline holds buffer_count sub-groups of 12 bytes/element in RAM (4 x 1.2 GB), where
# DeepSpeed's default of 1e9 would need 48 GB.
NVME_SUB_GROUP_SIZE = 100_000_000


def config_from_args(args: argparse.Namespace, world_size: int = 1) -> Config:
    """The JSON config (if any) with the flags laid over it, validated; its batch triple
    checked for `world_size` ranks (train_batch_size counts all of them)."""
    raw: dict[str, Any] = {}
    if args.config:
        from infinity.config.parse import read_json

        raw = read_json(args.config)
        if not isinstance(raw, dict):
            raise ValueError(
                f"config file {args.config!r} holds a JSON {type(raw).__name__}; a config is "
                'one JSON object such as {"train_micro_batch_size_per_gpu": 1}'
            )
    try:
        base: dict[str, Any] = Config.load(raw).to_dict() if args.config else {}
    except (TypeError, ValueError) as exc:  # TypeError: a value of the wrong type
        raise ValueError(f"config file {args.config!r}: {exc}") from None
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
        paths = [os.fspath(Path(p.strip()).expanduser()) for p in args.nvme.split(",")]
        nvme: str | list[str] = paths if len(paths) > 1 else paths[0]
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
    config = Config.load(base)
    if args.seed is None:
        check_seed(config.seed, f"the seed in {args.config}")
    # The batch triple is checked now, not after the data is tokenized.
    check_batch(config, world_size)
    return config


def check_inputs(args: argparse.Namespace) -> CausalLMSpec:
    """Errors that can be known before anything is built, each with its fix. Returns the
    model's description (its config read and checked), which the run builds from."""
    from infinity.models import hf_auto

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
    if args.resume and args.overwrite:
        raise ValueError(
            "--resume continues the run in --save-dir and --overwrite deletes it: give one"
        )
    save_dir = Path(args.save_dir).expanduser()
    if save_dir.exists() and not save_dir.is_dir():
        raise ValueError(f"--save-dir {save_dir} is a file, not a directory; give a directory")
    if args.resume and not save_dir.exists():
        raise ValueError(
            f"--resume: no checkpoint to continue from: {save_dir} does not exist; point "
            "--save-dir at the directory the earlier run saved into, or drop --resume to start "
            "a new run"
        )
    _create_save_dir(save_dir)
    if args.seed is not None:
        check_seed(args.seed)
    model_spec = hf_auto.describe(args.model)
    _check_seq_len(args.seq_len, model_spec)
    check_tokenizer_dir(args)
    lora_spec(args)
    _check_profile(args)
    return model_spec


# The step before a profile's: it traces the execution order and fills caches.
PROFILE_WARMUP_STEPS = 1


def _check_profile(args: argparse.Namespace) -> None:
    profile = getattr(args, "profile", None)
    if profile and args.steps and args.steps < profile + PROFILE_WARMUP_STEPS:
        fewer = args.steps - PROFILE_WARMUP_STEPS
        raise ValueError(
            f"--profile {profile} records {profile} steps after {PROFILE_WARMUP_STEPS} warm-up "
            f"step, but --steps is {args.steps}; use --steps {profile + PROFILE_WARMUP_STEPS} "
            "or more" + (f", or --profile {fewer}" if fewer >= 1 else "")
        )


def _create_save_dir(save_dir: Path) -> None:
    """Made now, so that a path that cannot be a directory fails before anything is built."""
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"--save-dir {save_dir} cannot be created ({exc.strerror}); choose a directory on a "
            "disk you can write to"
        ) from None


# torch.manual_seed takes up to 2**64 - 1, and the data order's PCG64 needs a non-negative seed.
SEED_MAX = 2**64 - 1


def check_seed(seed: int, where: str = "--seed") -> None:
    """Refuse a seed torch or the data order cannot take, naming it and where it came from."""
    if isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
        raise ValueError(
            f"{where} is {seed}, out of range: give a whole number from 0 to 2**64 - 1 ({SEED_MAX})"
        )


def _check_seq_len(seq_len: int, model: CausalLMSpec) -> None:
    limit = model.max_positions  # from the transformers config: GPT-2's n_positions too
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"--seq-len {seq_len} is longer than the model's max_position_embeddings "
            f"({limit}): positions past {limit} were never trained and its position tables "
            f"stop there; pass --seq-len {limit} or less"
        )


def tokenizer_dir(args: argparse.Namespace) -> Path | None:
    """Where the run's tokenizer is read from; None means UTF-8 bytes.

    [Note: which tokenizer] --byte-tokens asks for bytes; --tokenizer DIR names a directory;
    otherwise the model directory's own tokenizer is used, and a model directory without one
    is an error. A preset has random weights and no tokenizer, so it needs one of the two
    flags. Bytes are never chosen silently: a real model trained on bytes learns nothing
    useful and gives no error.
    """
    if args.byte_tokens:
        return None
    if args.tokenizer is not None:
        return Path(args.tokenizer).expanduser()
    return None if args.model in PRESETS else Path(args.model).expanduser()


def check_tokenizer_dir(args: argparse.Namespace) -> None:
    """The tokenizer the run will use exists (its files are read later, with the data)."""
    if args.byte_tokens and args.tokenizer is not None:
        raise ValueError(
            f"--byte-tokens and --tokenizer {args.tokenizer} contradict each other; pass one"
        )
    where = tokenizer_dir(args)
    if where is None:
        if not args.byte_tokens:
            raise ValueError(
                f"--model {args.model} is a preset with random weights and no tokenizer; pass "
                "--tokenizer DIR (a directory holding a Hugging Face tokenizer) or "
                "--byte-tokens to train on UTF-8 bytes"
            )
        return
    flag = "--tokenizer" if args.tokenizer is not None else "--model"
    if not where.is_dir():
        raise ValueError(f"{flag} {where}: no such directory; give the tokenizer's directory")
    if not tokenizer_files(where):
        raise ValueError(
            f"{flag} {where} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:6])}, ...); "
            "copy the model's tokenizer files there, pass --tokenizer DIR, or pass "
            "--byte-tokens to train on UTF-8 bytes"
        )
    require_transformers(where)


def run(args: argparse.Namespace) -> int:
    from infinity.cli.train_agree import check_same_run, describe_run
    from infinity.cli.train_ranks import FollowedRankZero, InputsRefused, join
    from infinity.cli.train_stop import StopSignals
    from infinity.utils.host_memory import unmap_large_allocations

    unmap_large_allocations()  # freed parameter-sized buffers leave RSS at once

    with StopSignals() as signals, contextlib.ExitStack() as held:
        ranks = None
        try:
            ranks = held.enter_context(join(Path(args.save_dir).expanduser(), args.comm_timeout))
            signals.rank = ranks.rank if ranks.many else None
            # Checked on every rank (a path one node lacks fails there only), said once.
            model, config = ranks.check_inputs(lambda: _inputs(args, ranks))
            if ranks.many:  # the same run on every rank, before any work is shared
                mine = ranks.check_inputs(
                    lambda: describe_run(args, config, model, world_size=ranks.world_size)
                )
                ranks.check_inputs(lambda: check_same_run(ranks.comm, mine))
            return _run(args, config, ranks, signals, held, model)
        except (FollowedRankZero, InputsRefused):
            return 1  # rank 0 says why
        except Exception as exc:
            if ranks is None or not ranks.many:
                raise
            return ranks.failed(exc)


def _inputs(args: argparse.Namespace, ranks) -> tuple[CausalLMSpec, Config]:
    """The checked inputs: the model's description and this rank's config."""
    from infinity.cli.train_agree import check_nvme_entries

    model = check_inputs(args)
    check_nvme_entries(args, getattr(ranks.comm, "local_world_size", ranks.world_size))
    # A per-rank nvme_path list becomes this rank's directory (the disk check reads it).
    config = config_from_args(args, ranks.world_size).for_local_rank(ranks.local_rank)
    return model, config


def _run(
    args, config: Config, ranks, signals, held: contextlib.ExitStack, model: CausalLMSpec
) -> int:
    from infinity.cli.train_run import TrainRun
    from infinity.cli.train_savedir import SaveDirClaim
    from infinity.cli.train_stop import StopNow

    try:
        # Held by rank 0 until the run ends or the process dies: a second run there is refused.
        save_dir = Path(args.save_dir).expanduser()
        claims: list[SaveDirClaim] = []
        ranks.decide(lambda: claims.append(held.enter_context(SaveDirClaim(save_dir))))
        ranks.start()
        signals.gone_ranks = ranks.gone_ranks
        run = TrainRun(args, config, ranks, model=model, claim=claims[0] if claims else None)
    except StopNow as stop:
        ranks.say(f"stopped by {stop.name} before training started", err=True)
        return stop.exit_code
    return run.run(signals)


__all__ = [
    "check_inputs",
    "check_seed",
    "check_tokenizer_dir",
    "config_from_args",
    "lora_spec",
    "positive_int",
    "register",
    "run",
    "tokenizer_dir",
]
