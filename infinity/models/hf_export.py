"""Write a Hugging Face model directory (config.json + sharded safetensors + index) tensor by
tensor, atomically: built under a temporary name next to `out_dir`, then renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from infinity.models.config import LlamaConfig
from infinity.models.hf_load import INDEX_FILE, SINGLE_FILE
from infinity.utils.fsio import fault_point, fsync_dir, write_file_atomic
from infinity.utils.safetensors_stream import StreamingSafetensorsWriter

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' (or a torch dtype) -> torch dtype."""
    if isinstance(value, torch.dtype) and value in _DTYPE_NAMES:
        return value
    if value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"export dtype {value!r} is not supported; use one of {list(DTYPES)}")


def export_hf(
    named_tensors: Iterable[tuple[str, torch.Tensor | Callable[[], torch.Tensor]]],
    config: LlamaConfig | dict,
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "bf16",
    max_shard_bytes: int = 5 << 30,
    extra_files: Iterable[str | os.PathLike] = (),
) -> Path:
    """Write `named_tensors` (HF names; values or callables) as a HF directory at `out_dir`.

    `config` is a `LlamaConfig` or the config.json content of any transformers model (its
    `to_dict()`); its dtype entry is set to the export's.

    Shards are cut at `max_shard_bytes` (a tensor larger than that gets a shard of its own).
    A tied `lm_head.weight` is skipped. `extra_files` (e.g. tokenizer.json) are copied in.
    Returns `out_dir`. Fails without touching `out_dir` if it exists.
    """
    dtype = parse_dtype(dtype)
    config = config.to_hf_dict() if isinstance(config, LlamaConfig) else dict(config)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"export target {out_dir} already exists; choose a new --out")
    tmp = out_dir.parent / f".tmp.{out_dir.name}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        shard_tensors = _write_shards(named_tensors, config, tmp, dtype, max_shard_bytes)
        _finish(tmp, shard_tensors, config, dtype, extra_files)
        fsync_dir(tmp)
        fault_point("export:before_rename")
        os.rename(tmp, out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %d shard(s) to %s", len(shard_tensors), out_dir)
    return out_dir


def _write_shards(named_tensors, config, tmp: Path, dtype, max_shard_bytes) -> list[dict]:
    shards: list[dict] = []  # {"file", "names", "nbytes"}
    writer = None
    try:
        for name, value in named_tensors:
            if config.get("tie_word_embeddings") and name == "lm_head.weight":
                continue
            tensor = value() if callable(value) else value
            tensor = tensor.detach().to("cpu", dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if writer is None or (
                writer.data_nbytes and writer.data_nbytes + nbytes > max_shard_bytes
            ):
                if writer is not None:
                    writer.close()
                shards.append({"file": f"part-{len(shards) + 1:05d}", "names": [], "nbytes": 0})
                writer = StreamingSafetensorsWriter(
                    tmp / shards[-1]["file"], metadata={"format": "pt"}
                )
            writer.add(name, tensor)
            shards[-1]["names"].append(name)
            shards[-1]["nbytes"] += nbytes
            del tensor, value
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if not shards:
        raise ValueError("export got no tensors; pass the model's named parameters")
    return shards


def _finish(tmp: Path, shards: list[dict], config, dtype, extra_files) -> None:
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        final = SINGLE_FILE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        os.rename(tmp / shard["file"], tmp / final)
        weight_map.update(dict.fromkeys(shard["names"], final))
    if n > 1:
        index = {
            "metadata": {"total_size": sum(s["nbytes"] for s in shards)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        write_file_atomic(tmp / INDEX_FILE, json.dumps(index, indent=2).encode())
    hf = dict(config)
    hf["torch_dtype"] = hf["dtype"] = _DTYPE_NAMES[dtype]
    write_file_atomic(tmp / "config.json", json.dumps(hf, indent=2).encode())
    for extra in extra_files:
        extra = Path(extra)
        shutil.copyfile(extra, tmp / extra.name)
        with open(tmp / extra.name, "rb") as f:
            os.fsync(f.fileno())
