"""The NVMe tier of parameter partitions: `NvmeParamStore`.

Owns where each half-precision partition lives on disk (one extent per parameter in the swap
store, kind "param", keyed by the parameter's stable name) and the transfers to and from it:
`swap_out(key, src)` and `swap_in(key, dst)` return futures. Transfers of one parameter keep
their order where it matters: a read never overtakes a pending write, nor a write a pending
read. It does not decide what to fetch or when: the coordinator
(`infinity.zero`) does, and it owns the pool buffers it is handed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from infinity.config.sections import AioConfig
from infinity.swap.aio import AioHandle
from infinity.swap.pool import PinnedBufferPool, PoolBuffer
from infinity.swap.store import Extent, SwapStore

logger = logging.getLogger(__name__)

KIND = "param"


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """One parameter partition on disk."""

    key: str
    numel: int
    dtype: torch.dtype
    extent: Extent


@dataclass(slots=True)
class ParamIOStats:
    bytes_read: int = 0
    bytes_written: int = 0
    wait_s: float = 0.0
    """Time callers spent in `wait()` on parameter transfers."""


class SwapFuture:
    """One parameter transfer. `wait()` returns the tensor holding the data (the destination
    of a swap_in, the source of a swap_out) and raises the I/O error, if any; it keeps the
    tensor alive until then. `buffer` is the pool buffer a swap_in landed in, if any: give it
    back with `NvmeParamStore.release`."""

    def __init__(
        self,
        owner: NvmeParamStore,
        op: str,
        layout: ParamLayout,
        tensor: torch.Tensor,
        future: Any,
        buffer: PoolBuffer | None = None,
    ) -> None:
        self._owner, self.op, self.layout = owner, op, layout
        self._tensor, self._future, self.buffer = tensor, future, buffer
        self._result: torch.Tensor | None = None

    @property
    def key(self) -> str:
        return self.layout.key

    def done(self) -> bool:
        return self._result is not None or self._future.done()

    def wait(self) -> torch.Tensor:
        if self._result is None:
            start = time.perf_counter()
            try:
                self._future.wait()
            except BaseException as e:
                if self.buffer is not None:
                    self._owner.release(self)
                raise NvmeParamError(
                    f"{self.op} of parameter {self.key!r} "
                    f"({self.layout.extent.nbytes} bytes at offset {self.layout.extent.offset} "
                    f"of {self.layout.extent.path}) failed: {e}"
                ) from e
            finally:
                self._owner.stats.wait_s += time.perf_counter() - start
            self._owner._finished(self)
            self._result = self._tensor
        return self._result


class NvmeParamError(OSError):
    """An NVMe transfer of a parameter partition failed."""


class NvmeParamStore:
    """Parameter partitions on NVMe, keyed by stable parameter names.

    `aio` is an `AioHandle` (shared, not closed here) or an `AioConfig` (made and owned).
    `pool` supplies destination buffers for `swap_in(key)` without `dst`. Calls come from one
    thread (the coordinator's); futures may be waited from any.
    """

    def __init__(
        self,
        *,
        store: SwapStore,
        aio: Any,
        pool: PinnedBufferPool | None = None,
    ) -> None:
        self.store = store
        self._owns_aio = isinstance(aio, AioConfig)
        self.aio = AioHandle.from_config(aio) if self._owns_aio else aio
        self.pool = pool
        self.stats = ParamIOStats()
        self._layouts: dict[str, ParamLayout] = {}
        self._written: set[str] = set()
        self._writing: dict[str, SwapFuture] = {}
        self._reading: dict[str, list[SwapFuture]] = {}
        self._closed = False

    def reserve(self, params: Mapping[str, tuple[int, torch.dtype]]) -> None:
        """Lay out partitions (name -> (numel, dtype)); checks free space for all of them."""
        sizes = {
            k: numel * torch.empty((), dtype=dtype).element_size()
            for k, (numel, dtype) in params.items()
        }
        extents = self.store.reserve(KIND, sizes)
        for k, (numel, dtype) in params.items():
            self._layouts[k] = ParamLayout(k, numel, dtype, extents[k])

    def layout(self, key: str) -> ParamLayout:
        try:
            return self._layouts[key]
        except KeyError:
            raise KeyError(
                f"parameter {key!r} has no NVMe home; reserve it first "
                f"({len(self._layouts)} reserved)"
            ) from None

    def swap_out(self, key: str, src: torch.Tensor) -> SwapFuture:
        """Start writing `src` (the partition's numel and dtype, any shape) to `key`'s home.
        `src` must not change until the future is waited."""
        layout = self.layout(key)
        self._check(layout, src, "swap_out source")
        self._settle(key)
        for pending in self._reading.pop(key, []):  # nor may it overwrite a read in flight
            with contextlib.suppress(NvmeParamError):  # that read's owner sees its error
                pending.wait()
        flat = src.reshape(-1)
        if flat.data_ptr() != src.data_ptr():
            raise ValueError(f"swap_out source for {key!r} must be contiguous")
        ext = layout.extent
        fut = SwapFuture(self, "swap_out", layout, src, self.aio.pwrite(flat, ext.path, ext.offset))
        self._writing[key] = fut
        return fut

    def swap_in(self, key: str, dst: torch.Tensor | None = None) -> SwapFuture:
        """Start reading `key` into `dst`, or into a pool buffer (waits while the pool is
        full). `wait()` returns the flat partition tensor."""
        layout = self.layout(key)
        if key not in self._written and key not in self._writing:
            raise ValueError(f"swap_in of {key!r}: it was never swapped out, so NVMe holds no data")
        self._settle(key)
        ext = layout.extent
        buf = None
        if dst is None:
            if self.pool is None:
                raise ValueError(f"swap_in of {key!r} without dst needs a buffer pool")
            buf = self.pool.acquire(ext.padded_nbytes, holder=key)
            io_buf = buf.data[: ext.padded_nbytes]  # whole pages: all O_DIRECT
            dst = buf.data[: ext.nbytes].view(layout.dtype)
        else:
            self._check(layout, dst, "swap_in destination")
            io_buf = dst.reshape(-1)
            if io_buf.data_ptr() != dst.data_ptr() or not dst.is_contiguous():
                raise ValueError(f"swap_in destination for {key!r} must be contiguous")
        try:
            fut = self.aio.pread(io_buf, ext.path, ext.offset)
        except BaseException:
            if buf is not None:
                self.pool.release(buf)
            raise
        future = SwapFuture(self, "swap_in", layout, dst, fut, buf)
        self._reading.setdefault(key, []).append(future)
        return future

    def release(self, future: SwapFuture) -> None:
        """Give back the pool buffer a swap_in landed in."""
        if future.buffer is not None:
            buf, future.buffer = future.buffer, None
            self.pool.release(buf)

    def flush(self) -> None:
        """Wait for every pending swap_out (raises the first failure)."""
        for fut in list(self._writing.values()):
            fut.wait()

    def close(self) -> None:
        """Wait for pending writes (raising the first failure once). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            if self._owns_aio and hasattr(self.aio, "close"):
                self.aio.close()

    def memory_stats(self) -> dict[str, int]:
        stats = {
            "nvme_param_bytes_read": self.stats.bytes_read,
            "nvme_param_bytes_written": self.stats.bytes_written,
            "nvme_param_wait_us": int(self.stats.wait_s * 1e6),
        }
        return stats | (self.pool.memory_stats() if self.pool is not None else {})

    def _finished(self, fut: SwapFuture) -> None:
        if fut.op == "swap_out":
            self.stats.bytes_written += fut.layout.extent.nbytes
            if self._writing.get(fut.key) is fut:
                del self._writing[fut.key]
            self._written.add(fut.key)
        else:
            self.stats.bytes_read += fut.layout.extent.nbytes
            reads = self._reading.get(fut.key, [])
            if fut in reads:
                reads.remove(fut)
                if not reads:
                    del self._reading[fut.key]

    def _settle(self, key: str) -> None:
        """A transfer of `key` must not overtake its pending write (nor a write its pending
        reads: see swap_out)."""
        pending = self._writing.get(key)
        if pending is not None:
            pending.wait()

    @staticmethod
    def _check(layout: ParamLayout, t: torch.Tensor, what: str) -> None:
        if t.dtype != layout.dtype or t.numel() != layout.numel or t.device.type != "cpu":
            raise ValueError(
                f"{what} for {layout.key!r} is {t.dtype} with {t.numel()} elements on "
                f"{t.device}; its NVMe home holds {layout.numel} {layout.dtype} elements "
                f"(pass a host tensor of that dtype and size)"
            )
