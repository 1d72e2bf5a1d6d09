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
    "use_local_device",
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


def use_local_device(local_rank: int) -> None:
    """Make the CUDA device of this process's local rank its current one (torchrun starts one
    process per device); nothing on the CPU. Call it before `get_accelerator()`."""
    if (os.environ.get("INFINITY_ACCELERATOR") or "").lower() == "cpu" or not cuda_available():
        return
    import torch

    count = torch.cuda.device_count()
    if count == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        local_rank = 0  # the launcher gave each process its own device
    if not 0 <= local_rank < count:
        raise ValueError(
            f"LOCAL_RANK is {local_rank} but this host sees {count} CUDA device(s); start at "
            f"most {count} processes per host (torchrun --nproc_per_node {count})"
        )
    torch.cuda.set_device(local_rank)
