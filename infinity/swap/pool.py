"""The pinned buffer pool: fixed host staging buffers for NVMe transfers.

Owns one arena of page-aligned buffers of `buffer_bytes` each, and optionally one more of
`large_bytes` for the few requests larger than that, allocated once (pinned directly when
the accelerator pins, never pinned by copying) and never grown. `acquire` hands out a whole
buffer of the class a request needs and blocks while none is free, with a timeout and an
error naming the holders; it never asserts. It does not decide what to swap or when.

[Note: an outlier's own buffer] A model's largest parameter can be many times its others (a
Llama-3 embedding: 262M elements against 17M for the largest linear layer of the 1B). Staging
buffers all sized for it hold mostly untouched memory: in a 1B run with five of them, 2,506
MiB were mapped and 1,100 MiB ever resident. `offload_param.buffer_size` "auto" now resolves
to the largest parameter of at most a quarter of the largest when no more than two, of 2^22
elements or more, are above it (`staging_numel` in infinity/config/resolve.py), and the pool
keeps one more buffer, of the largest parameter, for the parameters over `buffer_size` (also
when a set buffer_size is smaller than the largest, which DeepSpeed refuses); they wait for
each other, the others do not wait for them.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from infinity.accelerator import get_accelerator
from infinity.config import OffloadParamConfig, check_resolved
from infinity.io.aio import aligned_empty
from infinity.swap.store import ALIGN_BYTES, align_up

logger = logging.getLogger(__name__)

_MIB = float(1 << 20)


@dataclass(eq=False, slots=True)
class PoolBuffer:
    """One staging buffer, lent to `holder` until released."""

    index: int
    data: torch.Tensor
    """The whole buffer: uint8, `buffer_bytes` long, page-aligned."""
    holder: str = ""
    nbytes: int = 0
    """Bytes the holder asked for."""
    thread: int = field(default=0, repr=False)

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first `numel` elements of the buffer as a flat `dtype` tensor."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.data.numel():
            raise ValueError(
                f"{numel} {dtype} elements ({nbytes} bytes) do not fit a pool buffer of "
                f"{self.data.numel()} bytes"
            )
        return self.data[:nbytes].view(dtype)


def aligned_host_bytes(nbytes: int, *, pin: bool) -> tuple[torch.Tensor, bool]:
    """A page-aligned uint8 host buffer of `nbytes`, and whether it is pinned (allocated
    pinned by the accelerator when `pin` and it can, never pinned by copying).

    `aligned_empty` pins exactly when the accelerator can, and otherwise backs large buffers
    with huge pages (faster direct I/O); only an unpinned buffer on an accelerator that pins
    (pin_memory off, or pinning failed) is allocated here, page-aligned.
    """
    can_pin = get_accelerator().pin_supported()
    if pin == can_pin:
        return aligned_empty(nbytes, torch.uint8), can_pin
    raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN_BYTES
    return raw[skip : skip + nbytes], False


def memlock_allows(nbytes: int) -> tuple[bool, int]:
    """Whether RLIMIT_MEMLOCK allows locking `nbytes` more, and the soft limit (-1: none)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return True, -1
    return nbytes <= soft, soft


def param_buffer_numels(config: OffloadParamConfig, numels: Sequence[int]) -> tuple[int, int]:
    """(elements per parameter staging buffer, elements of the outlier buffer or 0) for
    parameters of `numels` elements: the resolved `offload_param.buffer_size` (`resolve_run`
    sizes an "auto" one for the model), and one buffer of the largest parameter when it does
    not fit (see [Note: an outlier's own buffer])."""
    check_resolved(config, "zero_optimization.offload_param")
    largest = max(numels, default=1)
    numel = config.buffer_size
    return numel, (largest if largest > numel else 0)


def param_pool_nbytes(
    config: OffloadParamConfig, *, element_size: int, numels: Sequence[int]
) -> int:
    """Host bytes of the parameter staging pool: `buffer_count` page-aligned buffers of
    the ordinary size and the outlier buffer (see `param_buffer_numels`)."""
    numel, large = param_buffer_numels(config, numels)
    return config.buffer_count * align_up(numel * element_size) + (
        align_up(large * element_size) if large else 0
    )


class PinnedBufferPool:
    """`buffer_count` host buffers of `buffer_bytes` (and with `large_bytes` one more of that
    size among them, for larger requests), allocated once.

    Thread-safe. `peak_bytes_in_use` (bytes asked for, high-water mark) and `pinned` feed
    memory stats.
    """

    def __init__(
        self,
        buffer_count: int,
        buffer_bytes: int,
        *,
        pin: bool = True,
        timeout_s: float = 300.0,
        name: str = "swap",
        large_bytes: int = 0,
    ) -> None:
        if buffer_count < 1 or buffer_bytes < 1:
            raise ValueError(
                f"{name} pool: buffer_count={buffer_count} and buffer_bytes={buffer_bytes} "
                f"must both be >= 1"
            )
        self.name = name
        self.buffer_bytes = align_up(buffer_bytes)
        self.large_bytes = align_up(large_bytes) if large_bytes > self.buffer_bytes else 0
        sizes = [self.buffer_bytes] * buffer_count
        sizes += [self.large_bytes] if self.large_bytes else []
        self.buffer_count = len(sizes)
        self.timeout_s = timeout_s
        pin = pin and get_accelerator().pin_supported()
        self.arena, self.pinned = self._allocate(sum(sizes), pin)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self._buffers = [
            PoolBuffer(i, self.arena[start : start + size])
            for i, (start, size) in enumerate(zip(starts, sizes, strict=True))
        ]
        # Free buffers by class: the ordinary ones, and the outlier's (see the module's note).
        self._free = [b for b in reversed(self._buffers) if b.data.numel() == self.buffer_bytes]
        self._free_large = [b for b in self._buffers if b.data.numel() == self.large_bytes]
        self._cond = threading.Condition()
        self.bytes_in_use = 0
        self.peak_bytes_in_use = 0

    @classmethod
    def for_params(
        cls,
        config: OffloadParamConfig,
        *,
        element_size: int,
        numels: Sequence[int],
        prefetch_numel: int = 0,
    ) -> PinnedBufferPool:
        """The parameter staging pool from `offload_param` for parameters of `numels`
        elements: `buffer_count` buffers of `buffer_size` elements (and the outlier's: see
        [Note: an outlier's own buffer]), pinned if `pin_memory`."""
        numel, large = param_buffer_numels(config, numels)
        depth = -(-prefetch_numel // max(numel, 1)) + 1
        # It matters when the buffers ahead of the one in use hold under half the window
        # (one buffer short of a small model's window waits for microseconds: no warning).
        if depth > config.buffer_count and 2 * (config.buffer_count - 1) * numel < prefetch_numel:
            logger.warning(
                "offload_param.buffer_count=%d buffers of %d elements hold less than the "
                "prefetch depth (%d elements + one in use, %d buffers): NVMe prefetch will "
                "wait for buffers; raise buffer_count to overlap it fully",
                config.buffer_count,
                numel,
                prefetch_numel,
                depth,
            )
        return cls(
            config.buffer_count, numel * element_size, pin=config.pin_memory, name="param",
            large_bytes=large * element_size,
        )  # fmt: skip

    def _allocate(self, total: int, pin: bool) -> tuple[torch.Tensor, bool]:
        """The arena, pinned if asked and possible. Over RLIMIT_MEMLOCK pinning is still tried
        (CUDA pins without mlock, so the limit rarely applies); if it fails, the arena is
        unpinned and a warning names the limit."""
        ok, soft = memlock_allows(total)
        limit = "unlimited" if soft < 0 else f"{soft / _MIB:.1f} MiB"
        if pin and not ok:
            logger.info(
                "%s pool: %.1f MiB of pinned buffers exceed RLIMIT_MEMLOCK (%s)",
                self.name, total / _MIB, limit,
            )  # fmt: skip
        if not pin:
            return aligned_host_bytes(total, pin=False)
        try:
            return aligned_host_bytes(total, pin=True)
        except RuntimeError as e:
            logger.warning(
                "%s pool: pinning %.1f MiB failed (%s; RLIMIT_MEMLOCK is %s); using unpinned "
                "buffers, so device copies will not be asynchronous. Raise the limit (ulimit -l "
                "unlimited, or memlock in /etc/security/limits.conf) or lower buffer_count",
                self.name, total / _MIB, e, limit,
            )  # fmt: skip
            return aligned_host_bytes(total, pin=False)

    @property
    def total_bytes(self) -> int:
        return sum(b.data.numel() for b in self._buffers)

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free) + len(self._free_large)

    def holders(self) -> list[str]:
        """Who holds each lent buffer (for error messages and debugging)."""
        with self._cond:
            return [b.holder for b in self._buffers if not self._is_free(b)]

    def try_acquire(self, nbytes: int, holder: str) -> PoolBuffer | None:
        """A buffer for `nbytes`, or None at once if none is free."""
        self._check_size(nbytes, holder)
        with self._cond:
            return self._take(nbytes, holder) if self._free_for(nbytes) else None

    def acquire(self, nbytes: int, holder: str, timeout_s: float | None = None) -> PoolBuffer:
        """A buffer for `nbytes`, waiting while none is free.

        ValueError at once if `nbytes` exceeds a buffer; RuntimeError at once if every buffer
        is held by this thread (waiting could never end); TimeoutError naming the holders
        after `timeout_s` (the pool's default when None).
        """
        self._check_size(nbytes, holder)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        me = threading.get_ident()
        with self._cond:
            while not self._free_for(nbytes):
                if all(b.thread == me for b in self._class(nbytes)):
                    raise RuntimeError(
                        f"{self.name} pool: {holder!r} waits for a buffer but this thread "
                        f"holds all {self.buffer_count} ({self._held_text()}); release one "
                        f"first or raise buffer_count"
                    )
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if self._free_for(nbytes):
                        break
                    raise TimeoutError(
                        f"{self.name} pool: {holder!r} waited {timeout_s:.1f} s for one of "
                        f"{self.buffer_count} buffers, all held ({self._held_text()}); raise "
                        f"buffer_count or release buffers sooner"
                    )
            return self._take(nbytes, holder)

    def release(self, buf: PoolBuffer) -> None:
        """Return `buf` to the pool (wakes one waiter)."""
        with self._cond:
            if self._is_free(buf) or self._buffers[buf.index] is not buf:
                raise ValueError(f"{self.name} pool: buffer {buf.index} is not lent out")
            self.bytes_in_use -= buf.nbytes
            buf.holder, buf.nbytes, buf.thread = "", 0, 0
            large = bool(self.large_bytes) and buf.data.numel() == self.large_bytes
            (self._free_large if large else self._free).append(buf)
            self._cond.notify_all()  # waiters of either class

    @contextmanager
    def borrow(self, nbytes: int, holder: str) -> Iterator[PoolBuffer]:
        """`acquire` for the duration of a `with` block."""
        buf = self.acquire(nbytes, holder)
        try:
            yield buf
        finally:
            self.release(buf)

    def _is_free(self, buf: PoolBuffer) -> bool:
        return buf in self._free or buf in self._free_large

    def _class(self, nbytes: int) -> list[PoolBuffer]:
        """The buffers a request of `nbytes` may use: the ordinary ones, or the outlier's."""
        if nbytes <= self.buffer_bytes:
            return [b for b in self._buffers if b.data.numel() == self.buffer_bytes]
        return [b for b in self._buffers if b.data.numel() == self.large_bytes]

    def _free_for(self, nbytes: int) -> list[PoolBuffer]:
        return self._free if nbytes <= self.buffer_bytes else self._free_large

    def _check_size(self, nbytes: int, holder: str) -> None:
        most = max(self.buffer_bytes, self.large_bytes)
        if nbytes > most or nbytes < 0:
            raise ValueError(
                f"{self.name} pool: {holder!r} needs {nbytes} bytes ({nbytes / _MIB:.1f} MiB) "
                f"but its largest buffer holds {most} ({most / _MIB:.1f} MiB); "
                f"raise offload_param.buffer_size to at least the largest parameter"
            )

    def _take(self, nbytes: int, holder: str) -> PoolBuffer:
        buf = self._free_for(nbytes).pop()
        buf.holder, buf.nbytes, buf.thread = holder, nbytes, threading.get_ident()
        self.bytes_in_use += nbytes
        self.peak_bytes_in_use = max(self.peak_bytes_in_use, self.bytes_in_use)
        return buf

    def _held_text(self) -> str:
        return ", ".join(f"{b.holder!r}: {b.nbytes} B" for b in self._buffers[:8]) + (
            "..." if self.buffer_count > 8 else ""
        )

    def memory_stats(self) -> dict[str, int]:
        return {
            f"{self.name}_pool_bytes": self.total_bytes,
            f"{self.name}_pool_pinned_bytes": self.total_bytes if self.pinned else 0,
            f"{self.name}_pool_peak_bytes_in_use": self.peak_bytes_in_use,
        }
