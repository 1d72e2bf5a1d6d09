"""What the ranks of one `infinity train` run must share, checked before anything is built.

Owns the run's description as each rank loaded it (`describe_run`: the model, tokenizer
and data by content, sequence length, precision, batch, schedule, LoRA, seed, steps and the
save directory, in the flags' names) and the check that every rank has the same one
(`check_same_run`), and that an --nvme list names one directory per process on the node
(`check_nvme_entries`). Ranks launched with different flags would otherwise train together
without a word (each shard stepping at its own lr, different data) or fail deep inside a
collective. What may differ between ranks (a per-rank --nvme directory, the progress bar) is
left out.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infinity.config import Config

if TYPE_CHECKING:
    from infinity.models.hf_auto import CausalLMSpec
    from infinity.run.options import RunOptions

# Bytes of the data file read at each end for its fingerprint (with its size).
DATA_SAMPLE_NBYTES = 1 << 20

# Config keys the flags set, named as the flags (the rest are named as config keys).
_FLAG_OF_KEY = {
    "optimizer.params.lr": "--lr",
    "train_micro_batch_size_per_gpu": "--micro-batch",
    "gradient_accumulation_steps": "--grad-accum",
    "seed": "--seed",
}
# Flags compared as given (the files are compared by content instead of by path).
_FLAGS = (
    "dtype",
    "data_field",
    "train_on_prompt",
    "pack",
    "overlong",
    "seq_len",
    "steps",
    "save_every",
    "eval_every",
    "keep_last",
    "resume",
    "overwrite",
    "activation_checkpointing",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
)


def describe_run(args: RunOptions, config: Config, model: CausalLMSpec) -> dict:
    """This rank's run, as {what (a flag or config key): value} (JSON values)."""
    from infinity.run.inputs import tokenizer_dir

    run: dict[str, Any] = {
        "--model": _model_digest(model),
        "--tokenizer": _files_digest(tokenizer_dir(args)),
        "--data": _data_digest(Path(args.data).expanduser()),
        "--chat-template": _template_digest(getattr(args, "chat_template", None)),
        "--save-dir": str(Path(args.save_dir).expanduser().resolve()),
    }
    if getattr(args, "eval_data", None) is not None:  # the ranks evaluate together
        run["--eval-data"] = _data_digest(Path(args.eval_data).expanduser())
    for name in _FLAGS:
        value = getattr(args, name, None)
        run["--" + name.replace("_", "-")] = list(value) if isinstance(value, tuple) else value
    # The config as loaded, before it is resolved: each rank resolves it once, later, for
    # facts that are the same on every rank (the model, the world size, the run's length),
    # so equal loaded configs resolve to equal values; their "auto"s compare as written.
    for key, value in _flat(config.to_dict()).items():
        if key.endswith("nvme_path"):
            continue  # a per-rank directory may differ
        if args.dtype is not None and key in ("fp16.enabled", "bf16.enabled"):
            continue  # the flag set them: compared as --dtype
        if key in _FLAG_OF_KEY:
            run[_FLAG_OF_KEY[key]] = value
        else:
            run[f"config {key}"] = value
    return json.loads(json.dumps(run, default=str))


def differences(runs: list[dict]) -> list[str]:
    """Each setting the ranks' `runs` disagree on: the setting and each rank's value."""
    lines = []
    keys = list(dict.fromkeys(k for run in runs for k in run))
    for key in keys:
        values = [run.get(key) for run in runs]
        if all(v == values[0] for v in values):
            continue
        groups: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            groups.setdefault(json.dumps(value), []).append(rank)
        said = "; ".join(
            f"{'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))}: {_short(v)}"
            for v, r in groups.items()
        )
        lines.append(f"{key} ({said})")
    return lines


def check_same_run(comm: Any, run: dict) -> None:
    """Every rank's `run` (a collective): a `ValueError` on every rank naming the settings
    that differ and each rank's value."""
    runs = comm.all_gather_object(run)
    diff = differences(runs)
    if diff:
        raise ValueError(
            f"the {len(runs)} ranks were launched with different settings, and would train "
            "together on different runs:\n  - " + "\n  - ".join(diff) + "\ngive every rank "
            "the same flags, files and config (torchrun passes the same command to each)"
        )


def check_nvme_entries(args: RunOptions, local_ranks: int) -> None:
    """--nvme A,B names one directory per process on the node: an entry no process takes
    would never be checked or used, so it is a mistake to say now."""
    if args.nvme is None:
        return
    paths = [p.strip() for p in args.nvme.split(",")]
    if len(paths) > 1 and len(paths) != local_ranks:
        raise ValueError(
            f"--nvme lists {len(paths)} directories ({', '.join(paths)}) but {local_ranks} "
            f"process{'' if local_ranks == 1 else 'es'} run on this node: a list gives one "
            "directory per process (torchrun --nproc_per_node); give "
            f"{local_ranks} or a single directory that every process shares"
        )


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _short(value: str) -> str:
    return value if len(value) <= 80 else value[:77] + "..."


def _model_digest(model: CausalLMSpec) -> str:
    config = json.dumps(model.to_dict(), sort_keys=True, default=str)
    weights = []
    if model.model_dir is not None:
        weights = sorted(
            f"{p.name}:{p.stat().st_size}" for p in Path(model.model_dir).glob("*.safetensors")
        )
    what = "preset" if model.model_dir is None else "config.json and weight files"
    text = config + "|" + ",".join(weights)
    return f"{what} {hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _files_digest(where: Path | None) -> str:
    """The tokenizer by the content of its files (None: UTF-8 bytes)."""
    if where is None:
        return "UTF-8 bytes"
    from infinity.data.tokenizer import tokenizer_files

    h = hashlib.sha256()
    for name in sorted(tokenizer_files(where)):
        h.update(name.encode())
        try:
            h.update((where / name).read_bytes())
        except OSError as exc:
            h.update(str(exc).encode())
    return f"files {h.hexdigest()[:12]}"


def _data_digest(path: Path) -> str:
    """The data file by its size and the bytes at both ends (cheap for any size)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            h = hashlib.sha256(f.read(DATA_SAMPLE_NBYTES))
            f.seek(max(0, size - DATA_SAMPLE_NBYTES))
            h.update(f.read(DATA_SAMPLE_NBYTES))
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return f"{size} bytes, {h.hexdigest()[:12]}"


__all__ = ["check_nvme_entries", "check_same_run", "describe_run", "differences"]


def _template_digest(template: str | None) -> str | None:
    """The --chat-template file by its content (None: the tokenizer's own)."""
    return None if template is None else _data_digest(Path(template).expanduser())
