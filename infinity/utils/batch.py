"""A batch on its way into the model: tensors (in tuples, lists, dicts) moved to the device,
and the fp16 input rule (cast with `fp16.auto_cast`, else a float32 input is refused before
the model sees it)."""

from __future__ import annotations

from typing import Any

import torch


def to_device(obj: Any, device: torch.device, *, half: bool) -> Any:
    """`obj` with every tensor (in tuples, lists, dicts) on `device`, as a batch from a CPU
    data loader must be for the gathered parameters there; floating-point ones cast to fp16
    when `half` (fp16.auto_cast)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.to(device, non_blocking=obj.is_pinned())
        return obj.half() if half and obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(x, device, half=half) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device, half=half) for k, v in obj.items()}
    return obj


def check_fp16_inputs(obj: Any, where: str = "input") -> None:
    """Refuse a floating-point tensor other than fp16 in a batch for an fp16 model without
    `fp16.auto_cast`: its first layer would stop with a dtype mismatch deep inside the
    forward. DeepSpeed's engine passes such inputs through unchanged (and fails the same
    way); its `fp16.auto_cast` key casts them, as here. A 0-dim tensor passes (the
    Trainer's `num_items_in_batch`): in torch's type promotion a 0-dim tensor never widens
    an fp16 operand, so it cannot cause that mismatch."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != torch.float16 and obj.dim() > 0:
            raise TypeError(
                f"forward: {where} is a {str(obj.dtype).removeprefix('torch.')} tensor of "
                f"shape {tuple(obj.shape)} but the model runs in fp16 (fp16.enabled): set "
                '"fp16": {"enabled": true, "auto_cast": true} in the config to cast '
                "floating-point inputs to fp16, or pass .half() tensors"
            )
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            check_fp16_inputs(x, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            check_fp16_inputs(v, f"{where}[{k!r}]")
