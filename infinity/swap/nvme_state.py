"""The NVMe tier of the optimizer state: `NvmeStateTier`.

Owns each sub-group's fp32 master weights and Adam moments on disk (one extent per sub-group
in the swap store, kind "optim": master, exp_avg and exp_avg_sq back to back, or the 8-bit
layout of state_format.py), the ring of host buffers they pass through, and the read-ahead /
write-back pipeline of `sweep()`. It
implements the `StateTier` contract ([Note: sweep semantics] in state_tier.py); it does
not know what the optimizer computes.

[Note: NVMe sweep pipeline] With B host buffers: while the caller steps sub-group i in one
buffer, sub-group i-1 is being written back from another and i+1 (and further, while free
buffers last) is being read into the rest. The read of i+1 is always issued before i is
handed to the caller; when no buffer is free for it the oldest write-back is waited for
first. Buffers whose write-back has finished take further reads, and those are queued before
the write-back of the sub-group just stepped (the caller waits on reads, not on writes).
When the sweep ends, every write has completed, and the first sub-groups of the next sweep
start reading into the free buffers (`prefetch_next_sweep`; dropped by any other call, which
may change the state). A sub-group's disk extent is only read after its last write
completed. A failed I/O, or a read that finds other bytes than were written (see [Note:
extent checksums] in infinity/io/checksum.py), marks the tier failed: every later call
raises, so a torn or changed state is never presented as valid.

[Note: moments never written] A sub-group's first state is its master and two moments of
zeros. `initialize` writes the master's pages only; until the sub-group is next written
whole (the first sweep's write-back, `write`), its reads take the master's pages only and
zero the moments in the host buffer, and `read_range` of a moment returns zeros. So the
moments' part of the extent is never written as zeros and never read while it holds nothing:
the first state costs a third of the disk traffic, and no checksum is asked about bytes that
were never written (what those bytes hold on disk, a hole or an old file's contents, is
never seen).

With `pipeline_read` off, a sub-group is read only when its turn comes (no read runs while
the caller steps, none is issued for the next sweep); with `pipeline_write` off, every
write-back is waited for before the next sub-group is read. Both off: strictly serial.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infinity.io.aio import aligned_empty
from infinity.io.extent import ExtentError, ExtentIO, Transfer
from infinity.swap.pool import PinnedBufferPool, PoolBuffer
from infinity.swap.state_sizes import (
    nvme_state_footprint,
    pipeline_buffer_count,
    state_buffers,
    state_nbytes,
)
from infinity.swap.state_tier import (
    StateFormat,
    SubGroupState,
    SubGroupState8,
    check_format,
    sweep_order,
)
from infinity.swap.store import ALIGN_BYTES, SwapStore, align_up

logger = logging.getLogger(__name__)

__all__ = [
    "NvmeStateError",
    "NvmeStateTier",
    "Residency",
    "nvme_state_footprint",
    "pipeline_buffer_count",
    "state_buffers",
    "state_nbytes",
]

KIND = "optim"


class Residency(enum.Enum):
    """Where a sub-group's latest state is."""

    ON_NVME = "the disk extent holds the latest state"
    READING = "being read into a host buffer (the disk copy is still the latest)"
    RESIDENT = "in a host buffer, lent to the caller, who may modify it"
    WRITING = "being written back; the disk extent is torn until the write completes"
    FAILED = "a write failed: the disk extent is torn"


class NvmeStateError(ExtentError):
    """An NVMe transfer of optimizer state failed; the tier refuses further use."""


ADVICE = (
    "The NVMe optimizer state is no longer consistent; free space or fix the disk, then "
    "resume from the last checkpoint"
)


@dataclass(slots=True)
class _Transfer:
    index: int
    buf: PoolBuffer
    future: Transfer | None
    op: str  # "read" | "write"


class NvmeStateTier:
    """Optimizer state on NVMe, swept through `buffer_count` host buffers.

    `aio` is an `AioHandle` (shared, not closed here) or an `AioConfig` (a handle is made and
    owned). `buffer_count` >= 3: one sub-group stepped, one read ahead, one written back;
    each buffer holds the largest sub-group (12 bytes per element; `fmt` 8-bit: 6 and 1/32,
    see state_format.py), and fewer sub-groups
    than that get as many buffers (`pipeline_buffer_count`). `pin_memory` allocates
    them pinned where the accelerator can (`pool.pinned` says whether it did).
    `pipeline_read` / `pipeline_write` switch the read-ahead and the write-behind overlap (see
    [Note: NVMe sweep pipeline]; the results are the same either way). With
    `prefetch_next_sweep` (and `pipeline_read`), the end of a sweep starts reading the first
    sub-groups of the next one into the free buffers, so the read at the start of a step
    overlaps the forward and backward passes; any other call drops those reads first. `kind`
    names the tier's extents in the swap store (two state tiers in one swap store need
    different kinds). `checksums` checks every read against what was written (see [Note:
    extent checksums] in infinity/io/checksum.py). `stats` counts the read and written
    bytes and the waits (read waits: read-ahead that was not early enough; write waits: for
    a buffer, or at the end of a sweep).
    Not thread-safe: one caller drives it.
    """

    def __init__(
        self,
        numels: Sequence[int],
        *,
        store: SwapStore,
        aio: Any,
        buffer_count: int = 4,
        pin_memory: bool = False,
        prefetch_next_sweep: bool = True,
        pipeline_read: bool = True,
        pipeline_write: bool = True,
        kind: str = KIND,
        checksums: bool = True,
        fmt: StateFormat = StateFormat.ADAMW,
    ) -> None:
        if buffer_count < 3:
            raise ValueError(
                f"offload_optimizer.buffer_count={buffer_count}: the NVMe optimizer pipeline "
                f"needs at least 3 buffers (read ahead, step, write back); set it to 3 or more"
            )
        self.numels = list(numels)
        self.format = fmt
        self.store = store
        self.io = ExtentIO(
            aio, tier="optim", error=NvmeStateError, advice=ADVICE, checksums=checksums
        )
        self.aio = self.io.aio
        sizes = {self._key(i): state_nbytes(n, fmt) for i, n in enumerate(self.numels)}
        self._extents = list(store.reserve(kind, sizes).values()) if sizes else []
        count, slot_bytes = state_buffers(self.numels, buffer_count, fmt)
        self.pool = PinnedBufferPool(count, slot_bytes, pin=pin_memory, name="optim")
        self.residency = [Residency.ON_NVME] * len(self.numels)
        self._fresh = [False] * len(self.numels)
        """Sub-groups whose moments were never written: zeros (see [Note: moments never
        written])."""
        self.stats = self.io.stats
        self._writes: deque[_Transfer] = deque()
        self.prefetch_next_sweep = prefetch_next_sweep
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        self._ahead: deque[_Transfer] = deque()  # reads issued for the next sweep
        self._ahead_order: list[int] = []  # ...whose order starts with theirs
        self._active: weakref.ref | None = None  # the last sweep iterator
        self._sweeping = False
        self._closed = False

    @staticmethod
    def _key(index: int) -> str:
        return f"subgroup.{index}"

    # -- the StateTier contract -----------------------------------------------------------

    def initialize(self, index: int, master: torch.Tensor) -> None:
        """Queue sub-group `index`'s first write: the master from `master`, and nothing else
        (see [Note: moments never written]); it is durable before the next sweep or read
        reaches it."""
        self._check_usable("initialize")
        self._drop_ahead()
        self._check(index, master, "master")
        self._settle(index)
        buf = self._free_buffer(index)
        self._views(index, buf).master.copy_(master.reshape(-1))
        self._swap_out(index, buf, whole=False)

    def sweep(
        self, order: Sequence[int] | None = None
    ) -> Iterator[tuple[int, SubGroupState | SubGroupState8]]:
        """Every sub-group in `order` (default ascending), pipelined (see [Note: NVMe sweep
        pipeline]; reads run ahead along `order`, and the next sweep's first reads assume it
        keeps the same order: another order drops them)."""
        gen = self._sweep(sweep_order(order, len(self.numels)))
        self._active = weakref.ref(gen)
        return gen

    def _sweep(self, order: list[int]) -> Iterator[tuple[int, SubGroupState | SubGroupState8]]:
        self._check_usable("sweep")
        if self._ahead_order != order:
            self._drop_ahead()  # read for a sweep in another order
        self._sweeping = True
        reads, self._ahead = self._ahead, deque()
        current: tuple[int, PoolBuffer] | None = None
        try:
            ahead = self.pipeline_read
            if not self.pipeline_write:  # no write-back of `initialize` or `write` either
                self._drain()
            for pos, i in enumerate(order):
                if not reads:
                    self._read_ahead(reads, order, pos, minimum=1, most=None if ahead else 1)
                t = reads.popleft()
                assert t.index == i, (t.index, i)
                current = (i, t.buf)
                self._wait(t)
                if ahead:
                    self._read_ahead(reads, order, pos + 1, minimum=1)
                yield i, self._views(i, t.buf)
                # Reads go ahead of this write-back in the queue: the caller waits on reads.
                if ahead:
                    self._read_ahead(reads, order, pos + 1, minimum=0)
                current = None
                self._swap_out(i, t.buf)
                if not self.pipeline_write:
                    self._drain()
            self._drain()
            if self.prefetch_next_sweep and ahead:  # lands during forward and backward
                self._read_ahead(self._ahead, order, 0, minimum=0)
                self._ahead_order = order
        except GeneratorExit:
            self._unwind(current, reads)
            current = None
            self._drain()
            raise
        except BaseException:
            self._unwind(current, reads)
            current = None
            try:
                self._drain()
            except BaseException as e:  # the first error is the one to report
                logger.error("while stopping a failed sweep: %s", e)
            raise
        finally:
            self._sweeping = False

    def read(self, index: int) -> SubGroupState | SubGroupState8:
        """A copy of sub-group `index`'s state (waits for its pending write first)."""
        self._check_usable("read")
        self._drop_ahead()
        self._check(index, None, "state")
        self._settle(index)
        buf = self._free_buffer(index)
        t = self._swap_in(index, buf)
        try:
            self._wait(t)
            state = self._views(index, buf)
            return type(state)(*(x.clone() for x in state))
        finally:
            if self.residency[index] in (Residency.READING, Residency.RESIDENT):
                self.residency[index] = Residency.ON_NVME
            self.pool.release(buf)

    def read_range(self, index: int, field: str, start: int, stop: int) -> torch.Tensor:
        """A copy of elements [start, stop) of one field of sub-group `index`: only the
        pages holding them are read (into a buffer of their size, not a pool buffer)."""
        self._check_usable("read_range")
        self._drop_ahead()
        self._check(index, None, "state")
        base, dtype, n = self.format.field_offset(field, self.numels[index])
        if not 0 <= start <= stop <= n:
            raise ValueError(
                f"read_range({index}, {field!r}, {start}, {stop}): {field} has {n} elements, "
                f"so 0 <= start <= stop <= {n}"
            )
        self._settle(index)
        if self._fresh[index] and field != "master":
            return self.format.zeros(field, stop - start)
        size = torch.empty((), dtype=dtype).element_size()
        lo, hi = base + start * size, base + stop * size
        first = lo - lo % ALIGN_BYTES
        buf = aligned_empty(align_up(hi) - first, torch.uint8)
        ext = self._extents[index]
        what = f"optimizer sub-group {index}"
        # A failed read changes nothing on disk: it does not mark the tier failed.
        self.io.read(buf, ext.path, ext.offset + first, what=what, poison=False).wait()
        return buf[lo - first : hi - first].view(dtype)

    def write(self, index: int, state: SubGroupState | SubGroupState8) -> None:
        """Replace sub-group `index`'s state; durable once this returns."""
        self._check_usable("write")
        self._drop_ahead()
        check_format(self.format, state)
        self._check(index, state.master, "master")
        self._settle(index)
        buf = self._free_buffer(index)
        for dst, src in zip(self._views(index, buf), state, strict=True):
            dst.copy_(src.reshape(-1))
        self._swap_out(index, buf)
        self._drain()

    def close(self) -> None:
        """Wait for outstanding writes (raising a failure not yet reported), then drop the
        extents' handle. The swap store's files belong to the store's owner."""
        if self._closed:
            return
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()  # a sweep left suspended: keep its changes, drain its writes
        self._closed = True
        try:
            self._drop_ahead()
            self._drain()
        finally:
            self.io.close()

    def __enter__(self) -> NvmeStateTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def memory_stats(self) -> dict[str, int]:
        return {
            **self.io.memory_stats("nvme_optim"),
            "optim_host_buffer_bytes": self.pool.total_bytes,
            "optim_host_buffer_peak_bytes": self.pool.peak_bytes_in_use,
            "optim_host_buffer_pinned_bytes": self.pool.total_bytes if self.pool.pinned else 0,
        }

    # -- the pipeline ----------------------------------------------------------------------

    def _read_ahead(
        self,
        reads: deque[_Transfer],
        order: list[int],
        first: int,
        *,
        minimum: int,
        most: int | None = None,
    ) -> None:
        """Issue reads of `order[first:]` (`reads` holds those issued from `first` on): at
        least `minimum` ahead (waiting for write-backs to free buffers if needed), more (up
        to `most`) while buffers are free or their write-back is done."""
        pos = first + len(reads)
        while pos < len(order) and (most is None or len(reads) < most):
            nxt = order[pos]
            buf = self.pool.try_acquire(self._extents[nxt].padded_nbytes, self._key(nxt))
            if buf is None:
                if not self._writes:
                    return
                if len(reads) >= minimum and not self._writes[0].future.done():
                    return  # enough read ahead, and no buffer to reuse without waiting
                self._retire_write()
                continue
            self._settle(nxt)
            reads.append(self._swap_in(nxt, buf))
            pos += 1

    def _swap_in(self, index: int, buf: PoolBuffer) -> _Transfer:
        """Start reading sub-group `index` into `buf` (released if the request is refused)."""
        self._transition(index, (Residency.ON_NVME,), Residency.READING)
        return self._submit(_Transfer(index, buf, None, "read"))

    def _swap_out(self, index: int, buf: PoolBuffer, *, whole: bool = True) -> None:
        """Start writing `buf` back to sub-group `index` (released if the request is
        refused): all of it, or (`whole` False: `initialize`) the master only."""
        self._transition(index, (Residency.RESIDENT, Residency.ON_NVME), Residency.WRITING)
        self._fresh[index] = not whole
        self._writes.append(self._submit(_Transfer(index, buf, None, "write")))

    def _submit(self, t: _Transfer) -> _Transfer:
        """Start `t` (a failure marks the tier failed and raises; see ExtentIO): the whole
        extent, or only the master's pages while the moments were never written."""
        ext = self._extents[t.index]
        start = self.io.write if t.op == "write" else self.io.read
        what = f"optimizer sub-group {t.index}"
        nbytes = ext.padded_nbytes
        if self._fresh[t.index]:
            # The master leads every format's layout (StateFormat.fields).
            nbytes = min(nbytes, align_up(self.numels[t.index] * torch.float32.itemsize))
        try:
            t.future = start(t.buf.data[:nbytes], ext.path, ext.offset, what=what)
        except ExtentError:  # refused before any I/O (a bad path, a short file...)
            self.pool.release(t.buf)
            torn = t.op == "write"
            self.residency[t.index] = Residency.FAILED if torn else Residency.ON_NVME
            raise
        return t

    def _wait(self, t: _Transfer) -> None:
        """Wait for one transfer; on failure (the tier is then failed) raise."""
        try:
            t.future.wait()
        except ExtentError:
            if t.op == "write":
                self.residency[t.index] = Residency.FAILED
            raise
        if t.op == "read":
            self._transition(t.index, (Residency.READING,), Residency.RESIDENT)
            if self._fresh[t.index]:  # only the master was read: the moments are zeros
                self.format.reset_moments(self._views(t.index, t.buf))
        else:
            self._transition(t.index, (Residency.WRITING,), Residency.ON_NVME)

    def _retire_write(self) -> None:
        t = self._writes.popleft()
        try:
            self._wait(t)
        finally:
            self.pool.release(t.buf)

    def _settle(self, index: int) -> None:
        """Wait for the pending write of `index`, if any (reads must not overtake it)."""
        while self.residency[index] is Residency.WRITING:
            self._retire_write()

    def _drain(self) -> None:
        """Wait for every write; raise the first failure (after all have finished)."""
        first: BaseException | None = None
        while self._writes:
            try:
                self._retire_write()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _unwind(self, current: tuple[int, PoolBuffer] | None, reads: deque[_Transfer]) -> None:
        """A sweep stops early: keep the caller's changes to the sub-group it holds (unless
        the tier failed: then only free its buffer) and drop the reads ahead."""
        try:
            if current is not None:
                if self.io.failed is None:
                    self._swap_out(*current)
                else:  # dropped unchanged on disk: the tier refuses all use from now on
                    self.residency[current[0]] = Residency.ON_NVME
                    self.pool.release(current[1])
        finally:
            self._abandon(reads)

    def _drop_ahead(self) -> None:
        """Forget the reads issued for the next sweep (state may change before it)."""
        self._abandon(self._ahead)

    def _abandon(self, reads: deque[_Transfer]) -> None:
        """Let prefetched reads land (the kernel may still be filling their buffers) and
        drop them."""
        while reads:
            t = reads.popleft()
            t.future.drop()  # an unused read changes nothing on disk
            if self.residency[t.index] is Residency.READING:
                self.residency[t.index] = Residency.ON_NVME
            self.pool.release(t.buf)

    def _free_buffer(self, index: int) -> PoolBuffer:
        while True:
            buf = self.pool.try_acquire(self._extents[index].padded_nbytes, self._key(index))
            if buf is not None:
                return buf
            self._retire_write()

    # -- checks ----------------------------------------------------------------------------

    def _views(self, index: int, buf: PoolBuffer) -> SubGroupState | SubGroupState8:
        n = self.numels[index]
        return self.format.views(buf.data[: state_nbytes(n, self.format)], n)

    def _transition(self, index: int, sources: tuple[Residency, ...], to: Residency) -> None:
        now = self.residency[index]
        assert now in sources, f"sub-group {index}: {now.name} -> {to.name}"
        self.residency[index] = to

    def _check_usable(self, op: str) -> None:
        if self._closed:
            raise NvmeStateError(f"{op}: the NVMe state tier at {self.store.dir} is closed")
        self.io.check_usable(op)
        if self._sweeping:
            raise RuntimeError(f"{op} during a sweep: finish or close the sweep iterator first")

    def _check(self, index: int, t: torch.Tensor | None, what: str) -> None:
        if not 0 <= index < len(self.numels):
            raise IndexError(f"sub-group {index} out of range (there are {len(self.numels)})")
        if t is not None and t.numel() != self.numels[index]:
            raise ValueError(
                f"{what} for sub-group {index} has {t.numel()} elements, "
                f"the sub-group has {self.numels[index]}"
            )
