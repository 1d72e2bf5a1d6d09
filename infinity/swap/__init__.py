"""Moving tensors between host memory and NVMe: the async I/O handle and aligned buffers."""

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
