"""Swapping tensors between host memory and NVMe: async I/O, the swap store, buffer pools,
and the storage tiers of parameters and optimizer state."""

from infinity.swap.aio import (
    AioFallbackWarning,
    AioFuture,
    AioHandle,
    aligned_empty,
    preallocate,
)
from infinity.swap.aio_checks import AioError, available_backends

__all__ = [
    "AioError",
    "AioFallbackWarning",
    "AioFuture",
    "AioHandle",
    "aligned_empty",
    "available_backends",
    "preallocate",
]
