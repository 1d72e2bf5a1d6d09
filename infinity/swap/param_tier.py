"""The NVMe tier of parameter homes: `NvmeParamTier`.

Owns where each half-precision home lives on disk (one extent per parameter in the swap
store, kind "param", keyed by the parameter's stable name; or a sub-range of the optimizer's
flat extent, see [Note: the flat extent]) and the transfers to and from it: `swap_out(key,
src)`, `swap_in(key, dst)` and `write_flat(start, src)` return futures. Transfers keep their
order where it matters (see [Note: transfer order]). It does not decide what to fetch or when:
the coordinator (`infinity.zero`) does, and it owns the pool buffers it is handed.

[Note: the flat extent] `reserve_flat` lays out the optimizer's flat element space as one
extent (key "flat") and gives each trainable parameter a layout that is a sub-range of it.
Parameters start at a multiple of 2048 elements, so each starts on a 4 KiB boundary; a read
into a pool buffer covers the page-padded length (whole pages, all O_DIRECT), and the padding
after a parameter up to the next page belongs to nobody. The optimizer writes whole sub-groups
with `write_flat`; a parameter is readable once every one of its elements has been written.

[Note: transfer order] Transfers are ordered by the byte ranges they touch (page-padded): a
write (`swap_out`, `write_flat`) first lets every pending read it overlaps land and waits for
every pending write it overlaps; a read waits for the pending writes it overlaps. A failed
write stays pending, so every later transfer over its range raises its error: a range whose
last write failed is never read as valid. Every read is checked against what was written
there (see [Note: extent checksums] in infinity/io/checksum.py).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from infinity.io.extent import ExtentError, ExtentIO, Transfer
from infinity.swap.pool import PinnedBufferPool, PoolBuffer
from infinity.swap.store import ALIGN_BYTES, Extent, SwapStore, align_up

logger = logging.getLogger(__name__)

KIND = "param"
FLAT_KEY = "flat"


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """One parameter home on disk."""

    key: str
    numel: int
    dtype: torch.dtype
    extent: Extent


@dataclass(frozen=True, slots=True)
class FlatExtent:
    """The optimizer's flat element space on disk (see [Note: the flat extent])."""

    total: int
    dtype: torch.dtype
    itemsize: int
    extent: Extent


class SwapFuture:
    """One parameter transfer. `wait()` returns the tensor holding the data (the destination
    of a swap_in, the source of a swap_out) and raises the I/O error, if any; it keeps the
    tensor alive until then. `buffer` is the pool buffer a swap_in landed in, if any: give it
    back with `NvmeParamTier.release` (a failed swap_in gives it back itself)."""

    def __init__(
        self,
        owner: NvmeParamTier,
        op: str,
        layout: ParamLayout,
        tensor: torch.Tensor,
        future: Transfer,
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
            try:
                self._future.wait()  # raises NvmeParamError (ExtentIO)
            except BaseException:
                self._owner._failed(self)
                raise
            self._owner._finished(self)
            self._result = self._tensor
        return self._result


class NvmeParamError(ExtentError):
    """An NVMe transfer of a parameter home failed."""


class _Coverage:
    """Which elements of the flat space have been written: sorted disjoint [start, stop)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []

    def add(self, start: int, stop: int) -> None:
        if stop <= start:
            return
        i = bisect.bisect_left(self.stops, start)  # first interval that may touch
        j = bisect.bisect_right(self.starts, stop)  # past the last one that may touch
        if i < j:
            start, stop = min(start, self.starts[i]), max(stop, self.stops[j - 1])
        self.starts[i:j], self.stops[i:j] = [start], [stop]

    def covers(self, start: int, stop: int) -> bool:
        if stop <= start:
            return True
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and self.stops[i] >= stop


def _overlap(a: Extent, b: Extent) -> bool:
    """Whether two extents share a page of one file (see [Note: transfer order])."""
    return (
        a.path == b.path
        and a.offset < b.offset + max(b.padded_nbytes, b.nbytes)
        and b.offset < a.offset + max(a.padded_nbytes, a.nbytes)
    )


class NvmeParamTier:
    """Parameter homes on NVMe, keyed by stable parameter names.

    `aio` is an `AioHandle` (shared, not closed here) or an `AioConfig` (made and owned).
    `checksums` checks every read against what was written. `pool` supplies destination
    buffers for `swap_in(key)` without `dst`. Calls come from one thread at a time; futures
    may be waited from any (the bookkeeping of pending transfers is locked).
    """

    def __init__(
        self,
        *,
        store: SwapStore,
        aio: Any,
        pool: PinnedBufferPool | None = None,
        checksums: bool = True,
    ) -> None:
        self.store = store
        # A failed transfer does not fail the tier: see [Note: transfer order].
        self.io = ExtentIO(aio, tier="param", error=NvmeParamError, checksums=checksums)
        self.aio = self.io.aio
        self.pool = pool
        self.stats = self.io.stats
        self._layouts: dict[str, ParamLayout] = {}
        self._written: set[str] = set()
        self._writing: dict[str, SwapFuture] = {}
        self._reading: dict[str, list[SwapFuture]] = {}
        self.flat: FlatExtent | None = None
        self._flat_range: dict[str, tuple[int, int]] = {}  # name -> flat [start, stop)
        self._flat_written = _Coverage()
        self._flat_writes: list[SwapFuture] = []
        self._lock = threading.Lock()  # guards the pending lists and sets above
        self._closed = False

    def reserve(self, params: Mapping[str, tuple[int, torch.dtype]]) -> None:
        """Lay out homes (name -> (numel, dtype)); checks free space for all of them."""
        self._check_new(params)
        sizes = {k: numel * dtype.itemsize for k, (numel, dtype) in params.items()}
        extents = self.store.reserve(KIND, sizes)
        for k, (numel, dtype) in params.items():
            self._layouts[k] = ParamLayout(k, numel, dtype, extents[k])

    def reserve_flat(
        self, entries: Mapping[str, tuple[int, int]], total: int, dtype: torch.dtype
    ) -> None:
        """Lay out the flat space of `total` elements of `dtype` as one extent, and each
        name -> (offset in elements, numel) as a parameter inside it (offsets 4 KiB-aligned
        in bytes, ranges disjoint and inside `total`). See [Note: the flat extent]."""
        if self.flat is not None:
            raise ValueError("reserve_flat: the flat extent is already reserved (once per tier)")
        self._check_new(entries)
        itemsize = dtype.itemsize
        spans = sorted((off, off + n, name) for name, (off, n) in entries.items())
        prev_stop, prev_name = 0, None
        for start, stop, name in spans:
            if start < 0 or stop < start or stop > total or (start * itemsize) % ALIGN_BYTES:
                raise ValueError(
                    f"reserve_flat: entry {name!r} = elements [{start}, {stop}) of {dtype} must "
                    f"lie inside [0, {total}) and start at a multiple of {ALIGN_BYTES} bytes "
                    f"({ALIGN_BYTES // itemsize} elements); lay slots out at SLOT_ALIGN"
                )
            if start < prev_stop:
                raise ValueError(
                    f"reserve_flat: entries {prev_name!r} and {name!r} overlap at element "
                    f"{start} (< {prev_stop})"
                )
            prev_stop, prev_name = stop, name
        ext = self.store.reserve(KIND, {FLAT_KEY: total * itemsize})[FLAT_KEY]
        self.flat = FlatExtent(total, dtype, itemsize, ext)
        for start, stop, name in spans:
            self._layouts[name] = self._flat_layout(name, start, stop)
            self._flat_range[name] = (start, stop)

    def _flat_layout(self, key: str, start: int, stop: int) -> ParamLayout:
        flat = self.flat
        assert flat is not None
        nbytes = (stop - start) * flat.itemsize
        ext = Extent(flat.extent.path, flat.extent.offset + start * flat.itemsize, nbytes,
                     align_up(nbytes))  # fmt: skip
        return ParamLayout(key, stop - start, flat.dtype, ext)

    def _check_new(self, names) -> None:
        dup = [k for k in names if k in self._layouts or k == FLAT_KEY]
        if dup:
            raise ValueError(f"parameters already reserved (or named {FLAT_KEY!r}): {dup[:5]}")

    def layout(self, key: str) -> ParamLayout:
        try:
            return self._layouts[key]
        except KeyError:
            raise KeyError(
                f"parameter {key!r} has no NVMe home; reserve it first "
                f"({len(self._layouts)} reserved)"
            ) from None

    def swap_out(self, key: str, src: torch.Tensor) -> SwapFuture:
        """Start writing `src` (the home's numel and dtype, any shape) to `key`'s home.
        `src` must not change until the future is waited."""
        layout = self.layout(key)
        self._check(layout, src, "swap_out source")
        flat = src.reshape(-1)
        if flat.data_ptr() != src.data_ptr() or not src.is_contiguous():
            raise ValueError(f"swap_out source for {key!r} must be contiguous")
        self._before_write(layout.extent)
        ext = layout.extent
        io = self.io.write(flat, ext.path, ext.offset, what=f"parameter {key!r}", op="swap_out")
        fut = SwapFuture(self, "swap_out", layout, src, io)
        with self._lock:
            self._writing[key] = fut
            if key in self._flat_range:
                self._flat_written.add(*self._flat_range[key])
        return fut

    def write_flat(self, start: int, src: torch.Tensor) -> SwapFuture:
        """Start writing flat `src` (the reserved dtype) at element `start` of the flat
        extent (`start` 4 KiB-aligned in bytes). `src` must not change until the future is
        waited. Ordered as in [Note: transfer order]."""
        flat = self.flat
        if flat is None:
            raise ValueError("write_flat before reserve_flat: reserve the flat extent first")
        n = src.numel()
        if (
            src.dtype != flat.dtype
            or src.device.type != "cpu"
            or not src.is_contiguous()
            or start < 0
            or start + n > flat.total
            or (start * flat.itemsize) % ALIGN_BYTES
        ):
            raise ValueError(
                f"write_flat of {n} {src.dtype} elements ({src.device}, contiguous: "
                f"{src.is_contiguous()}) at element {start}: the flat extent holds "
                f"{flat.total} {flat.dtype} elements; pass a contiguous host tensor of that "
                f"dtype starting at a multiple of {ALIGN_BYTES // flat.itemsize} elements"
            )
        layout = self._flat_layout(f"{FLAT_KEY}[{start}:{start + n}]", start, start + n)
        ext = layout.extent
        self._before_write(ext)
        what = f"flat elements [{start}, {start + n})"
        io = self.io.write(src.reshape(-1), ext.path, ext.offset, what=what, op="write_flat")
        fut = SwapFuture(self, "write_flat", layout, src, io)
        with self._lock:
            self._flat_writes.append(fut)
            self._flat_written.add(start, start + n)
        return fut

    def swap_in(
        self, key: str, dst: torch.Tensor | None = None, *, block: bool = True
    ) -> SwapFuture | None:
        """Start reading `key` into `dst`, or into a pool buffer (waiting while the pool is
        full; with `block=False` returning None at once instead, issuing nothing). `wait()`
        returns the home's flat tensor."""
        layout = self.layout(key)
        if not self._has_data(key):
            raise ValueError(f"swap_in of {key!r}: it was never swapped out, so NVMe holds no data")
        ext = layout.extent
        buf = None
        if dst is None:
            if self.pool is None:
                raise ValueError(f"swap_in of {key!r} without dst needs a buffer pool")
            if block:
                self._wait_writes(ext)  # before taking a buffer a failure would strand
                buf = self.pool.acquire(ext.padded_nbytes, holder=key)
            else:
                buf = self.pool.try_acquire(ext.padded_nbytes, holder=key)
                if buf is None:
                    return None
            io_buf = buf.data[: ext.padded_nbytes]  # whole pages: all O_DIRECT
            dst = buf.data[: ext.nbytes].view(layout.dtype)
        else:
            self._check(layout, dst, "swap_in destination")
            io_buf = dst.reshape(-1)
            if io_buf.data_ptr() != dst.data_ptr() or not dst.is_contiguous():
                raise ValueError(f"swap_in destination for {key!r} must be contiguous")
        try:
            self._wait_writes(ext)
            fut = self.io.read(io_buf, ext.path, ext.offset, what=f"parameter {key!r}",
                               op="swap_in", count=ext.nbytes)  # fmt: skip
        except BaseException:
            if buf is not None:
                self.pool.release(buf)
            raise
        future = SwapFuture(self, "swap_in", layout, dst, fut, buf)
        with self._lock:
            self._reading.setdefault(key, []).append(future)
        return future

    def release(self, future: SwapFuture) -> None:
        """Give back the pool buffer a swap_in landed in (nothing if already given back)."""
        if future.buffer is not None:
            buf, future.buffer = future.buffer, None
            self.pool.release(buf)

    def flush(self) -> None:
        """Wait for every pending swap_out and write_flat (raises the first failure)."""
        with self._lock:
            pending = [*self._writing.values(), *self._flat_writes]
        for fut in pending:
            fut.wait()

    def close(self) -> None:
        """Wait for pending writes (raising the first failure once). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self.io.close()

    def memory_stats(self) -> dict[str, int]:
        stats = self.io.memory_stats("nvme_param")
        return stats | (self.pool.memory_stats() if self.pool is not None else {})

    # ---- bookkeeping -----------------------------------------------------------------

    def _has_data(self, key: str) -> bool:
        with self._lock:
            if key in self._written or key in self._writing:
                return True
            span = self._flat_range.get(key)
            return span is not None and self._flat_written.covers(*span)

    def _finished(self, fut: SwapFuture) -> None:
        """Forget a landed transfer (its bytes are counted by ExtentIO, once)."""
        with self._lock:
            if fut.op == "swap_in":
                self._forget_read(fut)
            elif fut.op == "write_flat":
                if fut in self._flat_writes:
                    self._flat_writes.remove(fut)
            else:
                if self._writing.get(fut.key) is fut:
                    del self._writing[fut.key]
                self._written.add(fut.key)

    def _failed(self, fut: SwapFuture) -> None:
        """A transfer failed: a read gives its buffer back and is forgotten; a write stays
        pending (see [Note: transfer order])."""
        if fut.op == "swap_in":
            self.release(fut)
            with self._lock:
                self._forget_read(fut)

    def _forget_read(self, fut: SwapFuture) -> bool:
        reads = self._reading.get(fut.key, [])
        if fut not in reads:
            return False
        reads.remove(fut)
        if not reads:
            del self._reading[fut.key]
        return True

    def _wait_writes(self, ext: Extent) -> None:
        """Wait for the pending writes `ext` overlaps (raising their failure)."""
        with self._lock:
            pending = [f for f in self._writing.values() if _overlap(f.layout.extent, ext)]
            pending += [f for f in self._flat_writes if _overlap(f.layout.extent, ext)]
        for fut in pending:
            fut.wait()

    def _before_write(self, ext: Extent) -> None:
        """A write over `ext` overtakes neither a pending write nor a pending read there."""
        self._wait_writes(ext)
        with self._lock:
            reads = [
                f for fs in self._reading.values() for f in fs if _overlap(f.layout.extent, ext)
            ]
        for fut in reads:
            with contextlib.suppress(NvmeParamError):  # that read's owner sees its error
                fut.wait()

    @staticmethod
    def _check(layout: ParamLayout, t: torch.Tensor, what: str) -> None:
        if t.dtype != layout.dtype or t.numel() != layout.numel or t.device.type != "cpu":
            raise ValueError(
                f"{what} for {layout.key!r} is {t.dtype} with {t.numel()} elements on "
                f"{t.device}; its NVMe home holds {layout.numel} {layout.dtype} elements "
                f"(pass a host tensor of that dtype and size)"
            )
