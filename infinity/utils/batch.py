"""A batch on its way into the model: tensors (in tuples, lists, dicts) moved to the device,
and the fp16 input rule (cast with `fp16.auto_cast`, else a float32 input is refused before
the model sees it). The containers are walked by `torch.utils._pytree` (named tuples and
transformers' ModelOutputs keep their types)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def to_device(obj: Any, device: torch.device, *, half: bool) -> Any:
    """`obj` with every tensor (in tuples, lists, dicts) on `device`, as a batch from a CPU
    data loader must be for the gathered parameters there; floating-point ones cast to fp16
    when `half` (fp16.auto_cast)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device, non_blocking=t.is_pinned())
        return t.half() if half and t.is_floating_point() else t

    return pytree.tree_map_only(torch.Tensor, move, obj)


def check_fp16_inputs(obj: Any, where: str = "input", *, bf16: bool = False) -> None:
    """Refuse a floating-point tensor other than fp16 (bf16 with `bf16`) in a batch for a
    half-precision model without `fp16.auto_cast`: its first layer would stop with a dtype
    mismatch deep inside the forward. DeepSpeed's engine passes such inputs through
    unchanged (and fails the same way); its `fp16.auto_cast` key casts them, as here (bf16
    has no such key: the inputs are cast by the caller). A 0-dim tensor passes (the
    Trainer's `num_items_in_batch`): in torch's type promotion a 0-dim tensor never widens
    a half operand, so it cannot cause that mismatch."""
    want = torch.bfloat16 if bf16 else torch.float16
    fix = (
        "bf16 (bf16.enabled): pass .to(torch.bfloat16) tensors"
        if bf16
        else 'fp16 (fp16.enabled): set "fp16": {"enabled": true, "auto_cast": true} in the '
        "config to cast floating-point inputs to fp16, or pass .half() tensors"
    )
    for path, t in pytree.tree_flatten_with_path(obj)[0]:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        if t.is_floating_point() and t.dtype != want:
            raise TypeError(
                f"forward: {where}{pytree.keystr(path)} is a "
                f"{str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)} "
                f"but the model runs in {fix}"
            )
