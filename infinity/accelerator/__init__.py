"""The device behind one small interface: `get_accelerator()` returns CUDA or the CPU.

`INFINITY_ACCELERATOR=cpu|cuda` forces a choice; otherwise CUDA is used when torch sees it.
"""

from __future__ import annotations

import functools
import os

from infinity.accelerator.base import Accelerator, CopyCounters, Event, Stream, profile_range
from infinity.accelerator.cpu import CpuAccelerator

__all__ = [
    "Accelerator",
    "CopyCounters",
    "CpuAccelerator",
    "Event",
    "Stream",
    "cuda_available",
    "get_accelerator",
    "profile_range",
]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.cache
def get_accelerator(kind: str | None = None) -> Accelerator:
    kind = (kind or os.environ.get("INFINITY_ACCELERATOR") or "auto").lower()
    if kind not in ("auto", "cpu", "cuda"):
        raise ValueError(
            f"unknown accelerator {kind!r}; use 'cpu', 'cuda' or 'auto' (INFINITY_ACCELERATOR)"
        )
    if kind == "cpu" or (kind == "auto" and not cuda_available()):
        return CpuAccelerator()
    from infinity.accelerator.cuda import CudaAccelerator

    return CudaAccelerator()
