"""`infinity export CKPT --out DIR`: a checkpoint's weights as a Hugging Face directory.

Reads the `param/<name>` tensors of every rank's shard (see infinity.checkpoint.spans),
joins the per-rank spans of one weight at a time, and streams them into `export_hf`, so
memory stays near the largest weight.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch

from infinity.checkpoint import CheckpointNotFoundError, layout, load_checkpoint
from infinity.cli import export_lora
from infinity.cli.train_flags import add_accept_flag
from infinity.models import export_hf
from infinity.utils.sizes import parse_size


def open_checkpoint(path: Path, tag: str | None, *, accept_unverified: bool = False):
    """A checkpoint directory itself, or the newest checkpoint of a save directory that
    verifies (the one `infinity train --resume` continues from), or its `tag`. One whose
    checkpoint.json carries no checksum is refused unless `accept_unverified`."""
    if (path / layout.METADATA).is_file() and tag is None:
        return load_checkpoint(path.parent, path.name, accept_unverified=accept_unverified)
    try:
        return load_checkpoint(path, tag, accept_unverified=accept_unverified)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{exc}; give the --save-dir of a training run (its newest checkpoint is exported) "
            f"or one checkpoint directory (the one holding {layout.METADATA})"
        ) from None


def checkpoint_weights(
    ckpt, *, check: bool = True
) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """The model's config.json content and a (name, full tensor) stream from an engine
    checkpoint (any transformers causal LM: the config names its class). With `check`, a
    checkpoint without its frozen base (a LoRA run) is refused."""
    model = ckpt.state.get("model")
    if not model or "config" not in model or "param_shapes" not in model:
        raise ValueError(
            f"checkpoint {ckpt.path} has no model description (state['model'] with 'config' and "
            "'param_shapes'); it was not written by `infinity train`, so it cannot be exported"
        )
    config = dict(model["config"])
    if "model_type" not in config:
        raise ValueError(
            f"checkpoint {ckpt.path}: its model config has no model_type, so transformers could "
            "not load an export; it was written by an older `infinity train`"
        )
    if check and "base_model" in ckpt.state:
        raise ValueError(
            f"checkpoint {ckpt.path} holds only its trainable weights, not the frozen base "
            "it was trained on; it can be exported only as LoRA adapters (a run with --lora-r)"
        )
    shapes = {name: tuple(shape) for name, shape in model["param_shapes"].items()}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        # Each weight is joined from the spans the saved ranks hold (one rank: the whole).
        with ckpt.span_reader() as spans:
            for name, shape in shapes.items():
                numel = torch.Size(shape).numel()
                yield name, spans.read(layout.PARAM_PREFIX + name, numel, 0, numel).reshape(shape)

    return config, stream()


def _check_outputs(out: Path, extra: list[Path]) -> None:
    """--out and --copy-files are checked before any checkpoint is read."""
    for path in extra:
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ValueError(f"--copy-files {path} {what}; name files such as tokenizer.json")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, not a directory; choose another --out")


def run(args: argparse.Namespace) -> int:
    extra = [Path(p) for p in args.copy_files]
    _check_outputs(Path(args.out), extra)
    ckpt = open_checkpoint(
        Path(args.checkpoint), args.tag, accept_unverified=args.accept_unverified_checkpoint
    )
    if (args.adapter or args.base) and not export_lora.is_lora_checkpoint(ckpt):
        flag = "--adapter" if args.adapter else "--base"
        raise ValueError(
            f"{flag}: checkpoint {ckpt.path} has no LoRA adapters (it was not trained with "
            "--lora-r); export it without that flag"
        )
    if args.adapter:
        out = export_lora.export_adapter(ckpt, args.out)
        print(f"exported the adapter of {ckpt.path} (step {ckpt.step}) to {out}")
        return 0
    if export_lora.is_lora_checkpoint(ckpt):
        config, _ = checkpoint_weights(ckpt, check=False)
        out = export_lora.export_merged(ckpt, args, config)
        print(f"exported {ckpt.path} (step {ckpt.step}) merged into its base to {out}")
        return 0
    config, weights = checkpoint_weights(ckpt)
    out = export_hf(
        weights,
        config,
        args.out,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        extra_files=extra,
    )
    print(f"exported {ckpt.path} (step {ckpt.step}) to {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a checkpoint's weights as a Hugging Face model directory",
        description="Write config.json, sharded safetensors and an index, one tensor at a time. "
        "A LoRA checkpoint is merged into its base model, or written as the adapter alone "
        "with --adapter.",
    )
    parser.add_argument(
        "checkpoint", help="a --save-dir (uses its latest) or one checkpoint directory"
    )
    parser.add_argument("--out", required=True, help="new directory to create (must not exist)")
    parser.add_argument("--tag", help="checkpoint tag inside the save dir (default: latest)")
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default="bf16",
        help="dtype of the exported weights (default bf16)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=5 * 10**9,
        help="largest shard file, e.g. 5GB (default) or 500MB",
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA checkpoints: write the adapter alone (adapter_config.json + "
        "adapter_model.safetensors, loadable with peft.PeftModel.from_pretrained) instead of "
        "the merged model",
    )
    parser.add_argument(
        "--base",
        metavar="DIR",
        help="LoRA checkpoints: the base model directory to merge into, if it moved (default: "
        "the one recorded in the checkpoint; checked against its fingerprints)",
    )
    add_accept_flag(parser)
    parser.add_argument(
        "--copy-files",
        nargs="*",
        default=[],
        metavar="FILE",
        help="files to copy into the export, e.g. tokenizer.json",
    )
    parser.set_defaults(func=run)


__all__ = ["checkpoint_weights", "open_checkpoint", "register", "run"]
