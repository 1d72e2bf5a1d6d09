"""Consolidated 16-bit model weights: one safetensors file a model loader reads as is.

Owns writing (name, weights) pairs, one tensor in memory at a time, into `save_dir/filename`
atomically (a temporary name, fsync, rename: a crash leaves the previous file or none), plus
the model's `config.json` when there is one. It does not gather weights: the engine hands
it an iterator. `infinity export` does the same from a checkpoint, with sharding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from infinity.utils.fsio import fsync_dir, write_file_atomic
from infinity.utils.safetensors_stream import StreamingSafetensorsWriter

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def save_16bit_model(
    named_weights: Iterable[tuple[str, torch.Tensor | Callable[[], torch.Tensor]]],
    save_dir: str | os.PathLike,
    filename: str = "model.safetensors",
    *,
    dtype: torch.dtype = torch.bfloat16,
    config_json: str | None = None,
) -> Path:
    """Write every weight (a tensor, or a callable that reads it; floating-point ones as
    `dtype`) into
    `save_dir/filename`, and `config_json` (if given) as `save_dir/config.json`. `save_dir`
    is created if missing; other files in it are left alone. Returns the file's path."""
    if dtype not in SIXTEEN_BIT:
        raise ValueError(f"save_16bit_model: dtype must be float16 or bfloat16, got {dtype}")
    if not filename or os.path.basename(filename) != filename:
        raise ValueError(
            f"save_16bit_model: save_filename {filename!r} must be a plain file name; put "
            f"directories in save_dir"
        )
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    final = save_dir / filename
    tmp = save_dir / f".{filename}.tmp"
    try:
        with StreamingSafetensorsWriter(tmp, metadata={"format": "pt"}) as writer:
            for name, value in named_weights:
                tensor = (value() if callable(value) else value).detach().cpu()
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                writer.add(name, tensor.contiguous())
                del tensor, value
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if config_json is not None:
        write_file_atomic(save_dir / "config.json", config_json.encode())
    fsync_dir(save_dir)
    return final


def model_config_json(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """The Hugging Face `config.json` of `model` (Infinity's Llama, or a transformers model)
    with `dtype` as its weights' dtype; None when the model carries no such config."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_hf_dict"):
        data = config.to_hf_dict()
    elif hasattr(config, "to_json_string"):
        data = json.loads(config.to_json_string())
    else:
        return None
    data["torch_dtype"] = data["dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(data, indent=2)


def persistent_buffers(model: torch.nn.Module):
    """(name, buffer) of the buffers `model.state_dict()` holds (its persistent ones)."""
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf
