"""`infinity train`: fine-tune or pre-train a causal LM with offload, from the shell.

Owns the command: its flags (declared in `infinity.cli.train_flags`) and handing them to the
training-run library (`infinity.run.launch.train`), which checks the inputs, lays the flags
over the JSON config (`infinity.run.options`) and runs.
"""

from __future__ import annotations

import argparse

from infinity.cli.train_flags import (
    add_accept_flag,
    add_eval_flags,
    add_input_flags,
    add_lora_flags,
    add_run_flags,
    add_schedule_flags,
    add_training_flags,
)
from infinity.run.placement import add_placement_flags


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
    add_input_flags(parser)
    add_training_flags(parser)
    add_schedule_flags(parser)
    add_eval_flags(parser)
    add_lora_flags(parser)
    add_run_flags(parser)
    add_accept_flag(parser, "with --resume: ")
    add_placement_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from infinity.run.launch import train  # torch and the engine load only for a run
    from infinity.run.options import RunOptions

    return train(RunOptions.from_args(args))
