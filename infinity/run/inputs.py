"""The inputs of one training run, checked before any work starts.

Owns the errors that can be known from the options alone (the model directory or preset, the
data and --eval-data files, the save and --nvme directories, the tokenizer, the sequence
length and LoRA rank against the model, --profile against --steps), each with its fix, and
where the run's tokenizer is read from (`tokenizer_dir`). `infinity train` and `infinity
estimate` call them; the run itself is `infinity.run.training`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from infinity.data.source import check_data_file, check_data_options
from infinity.data.tokenizer import TOKENIZER_FILES, require_transformers, tokenizer_files
from infinity.models import PRESETS
from infinity.run.options import RunOptions, check_seed, lora_spec
from infinity.run.step import PROFILE_WARMUP_STEPS

if TYPE_CHECKING:
    from infinity.models.hf_auto import CausalLMSpec

log = logging.getLogger(__name__)


def check_inputs(args: RunOptions) -> CausalLMSpec:
    """Errors that can be known before anything is built, each with its fix. Returns the
    model's description (its config read and checked), which the run builds from. `args`
    with its sample defaults (`sample_defaults`), as the run gets them."""
    from infinity.models import hf_auto

    args = sample_defaults(args)
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
    check_data_options(check_data_file(Path(args.data).expanduser()), args.data_field)
    check_eval_data(args)
    _check_example_flags(args)
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
    _create_nvme_dirs(args.nvme)
    if args.seed is not None:
        check_seed(args.seed)
    model_spec = hf_auto.describe(args.model)
    check_seq_len(args.seq_len, model_spec)
    check_tokenizer_dir(args)
    check_lora_rank(lora_spec(args), model_spec)
    _check_profile(args)
    return model_spec


def sample_defaults(args: RunOptions) -> RunOptions:
    """Without --data, the sample corpus shipped in the package; for a model with no
    tokenizer (a preset without --tokenizer), UTF-8 byte tokens with it. Both said in the log
    (see [Note: which tokenizer]: bytes are chosen here only for a run that names no data,
    on random weights). `args` as it is when --data is given, else a copy with them."""
    if args.data is not None:
        return args
    from infinity.data.sample import SAMPLE_CORPUS, SAMPLE_DESCRIPTION

    args = replace(args, data=str(SAMPLE_CORPUS))
    log.info("no --data: training on the sample corpus, %s (%s)", SAMPLE_DESCRIPTION, args.data)
    if args.model in PRESETS and args.tokenizer is None and not args.byte_tokens:
        args = replace(args, byte_tokens=True)
        log.info(
            "--model %s has no tokenizer: UTF-8 byte tokens (ids 0-255, BOS 256, EOS 257); "
            "`infinity generate` on the save dir uses them too",
            args.model,
        )
    return args


def check_eval_data(args: RunOptions) -> None:
    """--eval-data is a data file the run can read, checked as --data is; --eval-every
    needs it."""
    eval_data = getattr(args, "eval_data", None)
    if eval_data is None:
        if getattr(args, "eval_every", None) is not None:
            raise ValueError(
                f"--eval-every {args.eval_every} needs --eval-data FILE (the validation data)"
            )
        return
    try:
        check_data_options(check_data_file(Path(eval_data).expanduser()), args.data_field)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--eval-data {eval_data}: {exc}") from None


def _check_example_flags(args: RunOptions) -> None:
    """The instruction-data flags name a readable template and come with instruction data."""
    from infinity.data.examples import file_kind

    if args.chat_template is not None and not Path(args.chat_template).expanduser().is_file():
        raise ValueError(
            f"--chat-template {args.chat_template}: no such file; give a Jinja chat template file"
        )
    given = [
        flag
        for flag, on in (
            ("--chat-template", args.chat_template is not None),
            ("--train-on-prompt", args.train_on_prompt),
            ("--pack", args.pack),
            ("--overlong", args.overlong != "truncate"),
        )
        if on
    ]
    if given and file_kind(Path(args.data).expanduser()) is None:
        raise ValueError(
            f"{', '.join(given)} shape instruction data, but {args.data} is pre-training data "
            "(text, or records with a text field, always packed); drop them, or give records "
            "with 'messages' or 'prompt' and 'completion'"
        )


def _create_nvme_dirs(flag: str | None) -> None:
    """Each --nvme directory exists before the data is tokenized: one whose parent exists is
    created (as --save-dir is); a missing parent or a file there is refused."""
    for entry in (flag or "").split(","):
        if not entry.strip():
            continue
        path = Path(entry.strip()).expanduser()
        if path.is_dir():
            _check_writable(path)  # whatever the plan puts there, the disk must take it
            continue
        if path.exists():
            raise ValueError(f"--nvme {path} is not a directory; give a directory on the SSD")
        if not path.parent.is_dir():
            raise ValueError(
                f"--nvme {path}: its parent {path.parent} does not exist; create it first or "
                "give a directory on a fast local SSD"
            )
        try:
            path.mkdir()
        except OSError as exc:
            raise ValueError(
                f"--nvme {path} cannot be created ({exc.strerror}); give a directory on a "
                "disk you can write to"
            ) from None


def _check_writable(path: Path) -> None:
    """--nvme DIR takes files from this user (the swap store's own check, made again when a
    rank opens its directory there, with a test write): checked up front, since the plan may
    put nothing there at first."""
    from infinity.swap.store import SwapStoreError, check_base_dir

    try:
        check_base_dir(str(path))
    except SwapStoreError as exc:
        raise ValueError(f"--nvme {path}: {exc}") from None


def check_seq_len(seq_len: int, model: CausalLMSpec) -> None:
    """--seq-len within the model's position tables (`train` and `estimate` alike)."""
    limit = model.max_positions  # from the transformers config: GPT-2's n_positions too
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"--seq-len {seq_len} is longer than the model's max_position_embeddings "
            f"({limit}): positions past {limit} were never trained and its position tables "
            f"stop there; pass --seq-len {limit} or less"
        )


def check_lora_rank(spec, model: CausalLMSpec) -> None:
    """The LoRA flags fit the model (targets that exist and can take an adapter, a rank no
    larger than the layers it adapts: `lora_targets`' rules), checked on the meta device
    before anything is built (`train` and `estimate` alike; `spec` None: no LoRA)."""
    if spec is None:
        return
    import torch

    from infinity.models import hf_auto
    from infinity.models.lora import lora_targets

    with torch.device("meta"):
        meta = hf_auto.build(model.hf_config, init_weights=False)
    lora_targets(meta, spec)


def _check_profile(args: RunOptions) -> None:
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
        why = exc.strerror
        if save_dir.is_symlink() and not save_dir.exists():  # dangling, or a loop
            why = f"it is a symbolic link to {os.readlink(save_dir)}, which leads nowhere"
        raise ValueError(
            f"--save-dir {save_dir} cannot be created ({why}); choose a directory on a "
            "disk you can write to"
        ) from None


def tokenizer_dir(args: RunOptions) -> Path | None:
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


def check_tokenizer_dir(args: RunOptions) -> None:
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


__all__ = [
    "check_inputs",
    "check_lora_rank",
    "check_seq_len",
    "check_tokenizer_dir",
    "tokenizer_dir",
]
