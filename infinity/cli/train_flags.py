"""The flags of `infinity train`: their value types and their registration, by group.

Owns what the command line accepts; the training-run library owns what the flags mean
(`infinity.run.options`: how they override the JSON config; `infinity.run.inputs`: the
checks of the inputs), and `infinity.cli.train` registers the command.
"""

from __future__ import annotations

import argparse
import math

from infinity.models import PRESETS
from infinity.run.schedule import add_optim_flag


def _parsed(text: str, convert, ok, rule: str):
    """`text` as a number (`convert` is int or float) for which `ok` holds, else argparse's
    error with the `rule` it broke."""
    try:
        value = convert(text)
    except ValueError:
        kind = "whole number" if convert is int else "number"
        raise argparse.ArgumentTypeError(f"{text!r} is not a {kind}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{value} {rule}")
    return value


def _positive_int(text: str) -> int:
    return _parsed(text, int, lambda v: v > 0, "must be positive")


positive_int = _positive_int  # the other commands' counts are checked the same way


def _positive_float(text: str) -> float:
    return _parsed(
        text, float, lambda v: v > 0 and math.isfinite(v), "must be a finite number and positive"
    )


def _dropout(text: str) -> float:
    return _parsed(text, float, lambda v: 0.0 <= v < 1.0, "is not in [0, 1)")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no layer; e.g. q_proj,v_proj")
    return names


def _add_example_flags(parser: argparse.ArgumentParser) -> None:
    """How instruction and chat records (`messages`, or `prompt` and `completion`) train."""
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template to render 'messages' records with, for a tokenizer that has "
        "none (or to replace its own)",
    )
    parser.add_argument(
        "--train-on-prompt",
        action="store_true",
        help="instruction data: take the loss on every token, not only the assistant turns or "
        "the completion",
    )
    parser.add_argument(
        "--pack",
        action="store_true",
        help="instruction data: pack several examples into each sequence instead of one padded "
        "example per sequence (their position ids restart at each example, which keeps each "
        "example's attention to itself)",
    )
    parser.add_argument(
        "--overlong",
        choices=("truncate", "drop"),
        default="truncate",
        help="instruction data: an example longer than --seq-len is truncated (default) or "
        "dropped; the log counts them",
    )


def add_input_flags(parser: argparse.ArgumentParser) -> None:
    """The model, the data, the tokenizer, the disk and the JSON config."""
    parser.add_argument(
        "--model",
        required=True,
        metavar="DIR|PRESET",
        help=f"a Hugging Face model directory, or a preset ({', '.join(PRESETS)})",
    )
    parser.add_argument(
        "--data",
        metavar="FILE",
        help="UTF-8 text (one document), JSONL (.jsonl: one JSON object per line, the text "
        "in the field --data-field names) or JSON (.json: an array of such objects, or JSON "
        "lines), gzip/bzip2/xz-compressed or not; tokenized with the model directory's "
        "tokenizer. Records with 'messages' (chat, rendered with the chat template) or "
        "'prompt' and 'completion' are fine-tuned on the answers only. Default: the sample "
        "corpus shipped with Infinity (239 KB of public-domain English; byte tokens on a "
        "preset without --tokenizer)",
    )
    parser.add_argument(
        "--data-field",
        default="text",
        metavar="NAME",
        help="the JSONL or JSON field that holds each document's text (default 'text')",
    )
    _add_example_flags(parser)
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
        "Unless the config sets sub_group_size, it becomes 2e7 elements (4 x 240 MB of host "
        "buffers)",
    )
    parser.add_argument("--config", metavar="FILE", help="DeepSpeed-style JSON config")


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """Steps, batch shape, learning rate, precision, activation checkpointing."""
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


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """The LoRA adapters (one argument group)."""
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


def add_accept_flag(parser: argparse.ArgumentParser, when: str = "") -> None:
    """--accept-unverified-checkpoint, for every command that reads a checkpoint."""
    parser.add_argument(
        "--accept-unverified-checkpoint",
        action="store_true",
        help=f"{when}read a checkpoint whose checkpoint.json carries no checksum (saved by an "
        "older Infinity, or the checksum removed), so its step and data position cannot be "
        "verified; refused without it",
    )


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Where the run saves, how it resumes, seeds, reports and waits."""
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
    parser.add_argument(
        "--report-to",
        choices=["none", "tensorboard"],
        default="none",
        help="also write each step's loss, learning rate, grad norm, tokens/s and time "
        "breakdown as TensorBoard events under SAVE_DIR/tensorboard (needs the tensorboard "
        "package: pip install 'infinity-trainer[tb]'); metrics.jsonl is always written",
    )


def add_eval_flags(parser: argparse.ArgumentParser) -> None:
    """The validation set and when it is evaluated (one argument group); what an
    evaluation computes is in `infinity.run.evaluation`."""
    group = parser.add_argument_group(
        "validation", "the loss and perplexity on held-out data as the model trains"
    )
    group.add_argument(
        "--eval-data",
        metavar="FILE",
        help="a validation file in the formats --data takes (and its --data-field), tokenized "
        "the same way; its loss and perplexity over all of it, in file order, are written to "
        "metrics.jsonl after the last step and every --eval-every steps",
    )
    group.add_argument(
        "--eval-every",
        type=_positive_int,
        metavar="N",
        help="with --eval-data: evaluate after every N optimizer steps too (counted from step "
        "0, so a resumed run keeps the schedule); default: only after the last step",
    )


def _non_negative_int(text: str) -> int:
    return _parsed(text, int, lambda v: v >= 0, "must be 0 or more")


_ratio = _dropout  # a fraction in [0, 1)


def _non_negative_float(text: str) -> float:
    return _parsed(
        text, float, lambda v: v >= 0 and math.isfinite(v), "must be a finite number, 0 or more"
    )


def add_schedule_flags(parser: argparse.ArgumentParser) -> None:
    """The learning-rate schedule and the weight decay (one argument group); their meaning
    is in `infinity.run.schedule`."""
    group = parser.add_argument_group(
        "schedule",
        "the learning rate over the run, as transformers' get_scheduler gives it "
        "(docs/training.md)",
    )
    group.add_argument(
        "--lr-schedule",
        choices=["constant", "linear", "cosine"],
        help="after the warmup: stay at --lr, or decay to --min-lr at the last step, linearly "
        "or along a half cosine (default: constant, or as the config's scheduler says)",
    )
    warmup = group.add_mutually_exclusive_group()
    warmup.add_argument(
        "--warmup-steps",
        type=_non_negative_int,
        metavar="N",
        help="raise the lr linearly from 0 over the first N optimizer steps (default 0)",
    )
    warmup.add_argument(
        "--warmup-ratio",
        type=_ratio,
        metavar="R",
        help="warm up over ceil(R x the run's steps) steps instead, R in [0, 1)",
    )
    group.add_argument(
        "--min-lr",
        type=_non_negative_float,
        metavar="LR",
        help="the lr linear and cosine decay to at the last step (default 0)",
    )
    group.add_argument(
        "--weight-decay",
        type=_non_negative_float,
        metavar="WD",
        help="AdamW's decoupled weight decay (config: optimizer.params.weight_decay, default 0)",
    )
    add_optim_flag(group)
    group.add_argument(
        "--convert-optim-state",
        action="store_true",
        default=None,
        help="resuming from a checkpoint whose optimizer state is in the other format "
        "(adamw vs adamw_8bit): convert it once instead of refusing "
        "(config: optimizer.params.convert_state)",
    )
