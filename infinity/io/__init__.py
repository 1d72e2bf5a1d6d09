"""Asynchronous file I/O of whole host buffers: the one path every NVMe transfer takes.

Owns the I/O handle and its futures (`aio`), the checks on buffers, files and engines and
`AioError` (`aio_checks`), the POSIX thread-pool engine that is the Python twin of the
native one (`aio_posix`; the native engines live in `infinity._aio`), the transfers every
NVMe tier composes (`extent`: submit, wait, count, `ExtentError`) and the checksums of what
they write (`checksum`). It knows nothing of what is stored where: the swap tiers
(`infinity.swap`) decide that.
"""

from infinity.io.aio import (
    AioFallbackWarning,
    AioFuture,
    AioHandle,
    aligned_empty,
    preallocate,
)
from infinity.io.aio_checks import AioError, available_backends, chosen_backend
from infinity.io.extent import ExtentError, ExtentIO, IOStats, Transfer

__all__ = [
    "AioError",
    "AioFallbackWarning",
    "AioFuture",
    "AioHandle",
    "ExtentError",
    "ExtentIO",
    "IOStats",
    "Transfer",
    "aligned_empty",
    "available_backends",
    "chosen_backend",
    "preallocate",
]
