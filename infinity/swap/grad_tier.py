"""Where the fp32 gradient sums live between backward and the optimizer step.

A gradient tier holds, for each optimizer sub-group, the fp32 sum of the gradients since the
last step. `HostGradTier` keeps all of them in one flat host buffer (4 bytes per trainable
element). `NvmeGradTier` keeps a few sub-groups in host buffers and the rest on disk, so its
RAM is `GRAD_BUFFERS` x the sub-group size whatever the model size. It owns the buffers, the
disk extents (kind "grad") and the sums of squares the global norm is made of; it does not
know what the optimizer computes from them.

[Note: spilled gradients] Backward reaches the sub-groups roughly from the last to the first,
so a sub-group is filled while it is one of the most recently used and written to disk once
it drops out of them (read back and added to at the next micro-step of an accumulation
window, the read of the sub-group below starting while backward fills the current one).
Every write records the norms of what it wrote by rows of 2048 elements, so at the step the
global norm is the exact sum of one value per sub-group made from them, without reading
the gradients: the host tier computes the same rows the same way, and the two give bitwise
the same norm. A small gradient (at most 1/`PARTIAL_FRACTION` of its sub-group, e.g. a
layer's norm weights, reached in backward after the rest of its layer) added to a sub-group
on disk is added there: only the rows it touches are read, added to, re-measured and written
back. The step takes the sub-groups in order (`take`), reading ahead into the free buffers,
and `release` forgets each one once stepped: a released sub-group reads as zeros without any
I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from infinity.io.aio import aligned_empty, zeroed
from infinity.io.extent import ExtentError, ExtentIO, Transfer
from infinity.swap.grad_plan import (
    GRAD_BUFFERS,
    GradPlan,
    GradResidency,
    disk_rows,
    grad_buffers,
    grad_footprint,
)
from infinity.swap.grad_plan import NORM_ROW_NUMEL as _NORM_ROW_NUMEL
from infinity.swap.store import SwapStore, align_up
from infinity.utils.exact_sum import ExactSum
from infinity.utils.sizes import FP32_BYTES

logger = logging.getLogger(__name__)

KIND = "grad"
_ADD_CHUNK_NUMEL = 1 << 18
"""Elements per piece of a 16-bit gradient's add into an fp32 buffer (see `add_into`)."""


class Norms(NamedTuple):
    """A flat fp32 tensor's L2 norms by rows of `_NORM_ROW_NUMEL` (and the short tail): what
    its sum of squares is made of, updatable row by row (see [Note: spilled gradients])."""

    rows: torch.Tensor
    """[numel // _NORM_ROW_NUMEL] fp32."""
    tail: torch.Tensor | None
    """0-d fp32, the norm of the last numel % _NORM_ROW_NUMEL elements (None if none)."""


def add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst += src, for a 16-bit `src` one piece of `_ADD_CHUNK_NUMEL` elements at a time.

    torch adds a 16-bit tensor into an fp32 one through an fp32 copy of the whole source. For
    a large gradient that copy is a fresh mapping the kernel zeroes page by page, then
    unmaps (at 2.1B parameters, 2.3 s of a 16 s forward and backward); in pieces of 1 MiB
    the allocator hands the same memory back every time. Elementwise, so the sums are the
    same bits either way."""
    if src.dtype == dst.dtype or src.numel() <= _ADD_CHUNK_NUMEL:
        dst.add_(src)
        return
    for lo in range(0, src.numel(), _ADD_CHUNK_NUMEL):
        hi = lo + _ADD_CHUNK_NUMEL
        dst[lo:hi].add_(src[lo:hi])


def row_norms(flat: torch.Tensor) -> Norms:
    """The norms a sum of squares is made of (see `sum_of_squares`)."""
    rows = flat.numel() // _NORM_ROW_NUMEL * _NORM_ROW_NUMEL
    norms = torch.linalg.vector_norm(flat[:rows].view(-1, _NORM_ROW_NUMEL), dim=1)
    return Norms(norms, tail_norm(flat[rows:]) if rows < flat.numel() else None)


def tail_norm(tail: torch.Tensor) -> torch.Tensor:
    """The norm of a short last row, measured as a whole row padded with zeros: the same
    bits as the row it is on another rank, where the slot's padding follows it (see [Note:
    the norm's order])."""
    row = torch.zeros(1, _NORM_ROW_NUMEL, dtype=tail.dtype)
    row[0, : tail.numel()] = tail
    return torch.linalg.vector_norm(row, dim=1)[0]


def sum_from_norms(norms: Norms) -> ExactSum:
    total = ExactSum.of_squares(norms.rows)
    if norms.tail is not None:
        total += ExactSum.of_squares(norms.tail.reshape(1))
    return total


def sum_of_squares(flat: torch.Tensor) -> ExactSum:
    """Sum of squares of a flat fp32 tensor, exact over its rows (inf/NaN propagate).

    [Note: accurate norms] One fp32 `vector_norm` over 1e8 elements came out 1% low on this
    machine (its accumulators grow too large to add small terms). Rows of `_NORM_ROW_NUMEL`
    reduced in fp32, their squares then summed exactly, are within 1e-8 and faster (one
    pass, better vectorized); see benchmarks/zero_optimizer_bench.py for the step's timings.

    [Note: the norm's order] Two ranks that each hold half of every parameter must clip by
    the same global norm, to the last bit, as one rank that holds them whole: otherwise the
    clip coefficient, and with it every weight, differs in its last bits. A sum of squares in
    fp32 or fp64 depends on the order and grouping of its terms, and the terms are grouped
    differently on every world size (one rank's flat space is every parameter whole; each of
    two ranks has half of each), so no order of adding can be the same on both. Two things
    make the norm the same whatever the ranks: (1) the rows are the same everywhere. A row
    is `_NORM_ROW_NUMEL` elements of one parameter, starting at a multiple of it in the
    parameter (`shard_align` rounds the shards to whole rows, slots and sub-groups start on
    whole rows), measured by one fp32 `vector_norm` per row whose order inside the row does
    not depend on the thread count (torch gives each row to one thread), a short last row
    as a whole row padded with zeros (`tail_norm`), so a row's norm is the same bits on any
    rank, tier or thread count; rows of padding are zero. (2) The rows' squares are added
    exactly (`infinity.utils.exact_sum.ExactSum`, fp64 integers by exponent), within a
    sub-group, across sub-groups and by the ranks' all-reduce: an exact sum has no order.
    The total is rounded once, so the norm is the same bits on one rank and on any number.
    """
    return sum_from_norms(row_norms(flat))


@runtime_checkable
class GradTier(Protocol):
    """The fp32 gradient sums of every sub-group, wherever they live: the contract the
    optimizer talks to (`HostGradTier`, `HalfGradTier`, `NvmeGradTier`, `DeviceGradTier`
    and `SplitGradTier`, which puts several of them side by side). The optimizer never asks
    which one it has; what differs between them is said by `on_device`, `host_resident` and
    `host_flat`."""

    numels: list[int]
    """Elements of each sub-group."""

    @property
    def on_device(self) -> int:
        """How many of the first sub-groups sum on the accelerator's device (their gradients
        are added there, never copied to the host in backward)."""
        ...

    def add(self, index: int, start: int, src: torch.Tensor) -> None:
        """Elements [start, start + src.numel()) of sub-group `index` += src."""
        ...

    def sums_of_squares(self) -> list[ExactSum]:
        """One exact sum per sub-group, in order (see [Note: the norm's order]): the global
        norm is made of them."""
        ...

    def take(self, index: int) -> torch.Tensor:
        """Sub-group `index`'s sum for the step, [numel] in host memory."""
        ...

    def release(self, index: int) -> None:
        """The step is done with sub-group `index`: it reads as zeros from now on."""
        ...

    def zero(self) -> None:
        """Forget every sum (a skipped step)."""
        ...

    def host_resident(self) -> list[bool]:
        """For each sub-group, whether its sum stays in host memory from backward to the
        step, `take` a view of it that is safe to read while backward adds to others (a step
        ahead reads those: see [Note: the overlapped step] in infinity/zero/overlap.py)."""
        ...

    def host_flat(self) -> torch.Tensor | None:
        """Every sub-group's sum back to back in one fp32 host buffer, if the tier keeps
        them so; else None."""
        ...

    def close(self) -> None:
        """Wait for what is outstanding and release the tier's resources. Idempotent."""
        ...

    def memory_stats(self) -> dict[str, int]:
        """Bytes held ("grad_host_bytes", and the tier's own counters)."""
        ...


class HostGradTier:
    """Every sub-group's gradient in one flat host buffer, allocated at first use."""

    on_device = 0

    def __init__(self, numels: Sequence[int]) -> None:
        self.numels = list(numels)
        self.footprint = grad_footprint(self.numels, nvme=False)
        self._starts = [0]
        for n in self.numels:
            self._starts.append(self._starts[-1] + n)
        self._flat: torch.Tensor | None = None

    @property
    def flat(self) -> torch.Tensor:
        """All sub-groups back to back: [sum(numels)] fp32."""
        if self._flat is None:
            self._flat = zeroed(self.footprint.host // FP32_BYTES)
        return self._flat

    def _view(self, index: int) -> torch.Tensor:
        return self.flat[self._starts[index] : self._starts[index + 1]]

    def add(self, index: int, start: int, src: torch.Tensor) -> None:
        """Elements [start, start + src.numel()) of sub-group `index` += src."""
        add_into(self._view(index)[start : start + src.numel()], src)

    def sums_of_squares(self) -> list[ExactSum]:
        """One value per sub-group, in order (see [Note: spilled gradients])."""
        return [sum_of_squares(self._view(g)) for g in range(len(self.numels))]

    def take(self, index: int) -> torch.Tensor:
        """Sub-group `index`'s gradient for the step: [numel] fp32 in host memory."""
        return self._view(index)

    def release(self, index: int) -> None:
        """The step is done with sub-group `index`: it reads as zeros from now on."""
        self._view(index).zero_()

    def zero(self) -> None:
        if self._flat is not None:
            self._flat.zero_()

    def host_resident(self) -> list[bool]:
        return [True] * len(self.numels)

    def host_flat(self) -> torch.Tensor:
        return self.flat

    def close(self) -> None:
        """Nothing outstanding."""

    def memory_stats(self) -> dict[str, int]:
        return {"grad_host_bytes": 0 if self._flat is None else self._flat.nbytes}


class NvmeGradError(ExtentError):
    """A gradient transfer to or from NVMe failed; the tier refuses further use."""


ADVICE = (
    "This step's gradients are lost; free space or fix the disk, then resume from the last "
    "checkpoint"
)


@dataclass(eq=False, slots=True)
class _Buffer:
    data: torch.Tensor
    """uint8, page-aligned, the largest sub-group's padded bytes."""
    future: Transfer | None = None
    """The write from it (free) or the read into it (READING) in flight."""
    written: int | None = None
    """The sub-group `future` writes, so a read of it waits for the write first."""


class NvmeGradTier:
    """Gradient sums on NVMe with `buffer_count` host buffers (see [Note: spilled gradients]):
    which sub-group is where is the plan's (`infinity.swap.grad_plan.GradPlan`), the
    transfers and the sums are the tier's.

    `aio` is an `AioHandle` (shared, not closed here) or an `AioConfig` (a handle is made and
    owned). `checksums` checks every read against what was written (see [Note: extent
    checksums] in infinity/io/checksum.py). Not thread-safe: the gradient hooks and the step
    run on one thread.
    """

    on_device = 0

    def __init__(
        self,
        numels: Sequence[int],
        *,
        store: SwapStore,
        aio: Any,
        buffer_count: int = GRAD_BUFFERS,
        kind: str = KIND,
        checksums: bool = True,
    ) -> None:
        self.numels = list(numels)
        self.plan = GradPlan(self.numels, buffer_count)  # refuses fewer than 2 buffers
        self.store = store
        self.io = ExtentIO(
            aio, tier="grad", error=NvmeGradError, advice=ADVICE, checksums=checksums
        )
        self.aio = self.io.aio
        sizes = {f"subgroup.{g}": n * FP32_BYTES for g, n in enumerate(self.numels)}
        self._extents = list(store.reserve(kind, sizes).values()) if sizes else []
        count, nbytes = grad_buffers(self.numels, buffer_count)
        self._buffers = [_Buffer(aligned_empty(nbytes, torch.uint8)) for _ in range(count)]
        self._norms: list[Norms | None] = [None] * len(self.numels)  # of the disk copy
        self._apply = _Apply(self)
        self.stats = self.io.stats
        self._closed = False

    # -- backward --------------------------------------------------------------------------

    def add(self, index: int, start: int, src: torch.Tensor) -> None:
        """Elements [start, start + src.numel()) of sub-group `index` += src."""
        self._check_usable("add")
        if self.plan.on_disk(index, src.numel()):
            self._add_on_disk(index, start, src)
            return
        b = self.plan.add(index, self._apply, self._idle)
        add_into(self._grads(self._buffers[b], index)[start : start + src.numel()], src)
        self.plan.added(index, b, self._apply)

    @property
    def residency(self) -> list[GradResidency]:
        """Where each sub-group's sum is (the plan's)."""
        return self.plan.residency

    # -- the step --------------------------------------------------------------------------

    def sums_of_squares(self) -> list[ExactSum]:
        """One value per sub-group, in order: recorded when written, computed for those in
        host buffers (see [Note: spilled gradients])."""
        self._check_usable("sums_of_squares")
        out = []
        for g, state in enumerate(self.residency):
            if state is GradResidency.ZERO:
                out.append(ExactSum())
            elif state is GradResidency.HOST:
                out.append(sum_of_squares(self._grads(self._buffers[self.plan.where[g]], g)))
            else:
                out.append(sum_from_norms(self._norms[g]))
        return out

    def take(self, index: int) -> torch.Tensor:
        """Sub-group `index`'s gradient for the step, then reads of the following sub-groups
        start into the free buffers."""
        self._check_usable("take")
        b = self.plan.take(index, self._apply, self._idle)
        return self._grads(self._buffers[b], index)

    def release(self, index: int) -> None:
        """The step is done with sub-group `index`: its buffer is free, it reads as zeros."""
        self.plan.release(index, self._apply)

    def zero(self) -> None:
        """Forget every gradient (a skipped step): no I/O, the reads ahead are waited for."""
        self.plan.zero(self._apply)

    def host_resident(self) -> list[bool]:
        """None: a sub-group may be written out and read back while backward runs."""
        return [False] * len(self.numels)

    def host_flat(self) -> None:
        return None

    def close(self) -> None:
        """Wait for every transfer (raising the first failure not yet reported)."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        try:
            for buf in self._buffers:
                try:
                    self._settle_buffer(buf)
                except BaseException as e:
                    first = first or e
        finally:
            self.io.close()
        if first is not None and self.io.failed is None:
            raise first

    def memory_stats(self) -> dict[str, int]:
        return {
            "grad_host_bytes": sum(b.data.nbytes for b in self._buffers),
            **self.io.memory_stats("nvme_grad"),
        }

    # -- buffers ---------------------------------------------------------------------------

    def _grads(self, buf: _Buffer, index: int) -> torch.Tensor:
        return buf.data[: self.numels[index] * FP32_BYTES].view(torch.float32)

    def _idle(self, b: int) -> bool:
        """Whether buffer `b`'s last transfer has finished (never blocks)."""
        fut = self._buffers[b].future
        return fut is None or fut.done()

    def _add_on_disk(self, index: int, start: int, src: torch.Tensor) -> None:
        """A small add to a sub-group on disk: read-add-write of the norm rows it touches
        only, and those rows' norms updated (see [Note: spilled gradients])."""
        lo, hi = disk_rows(start, src.numel(), self.numels[index])
        ext = self._extents[index]
        data = aligned_empty(align_up((hi - lo) * FP32_BYTES), torch.uint8)
        grads = data[: (hi - lo) * FP32_BYTES].view(torch.float32)
        self._settle_write_of(index)
        what = f"gradients of sub-group {index}"
        self.io.read(data, ext.path, ext.offset + lo * FP32_BYTES, what=what).wait()
        add_into(grads[start - lo : start - lo + src.numel()], src)
        self._update_norms(index, lo, grads)
        self.io.write(data, ext.path, ext.offset + lo * FP32_BYTES, what=what).wait()

    def _update_norms(self, index: int, lo: int, grads: torch.Tensor) -> None:
        norms, row = self._norms[index], _NORM_ROW_NUMEL
        full = grads.numel() // row * row
        if lo + full > norms.rows.numel() * row:  # the range ends in the tail
            full = norms.rows.numel() * row - lo
        if full:
            part = row_norms(grads[:full])
            norms.rows[lo // row : (lo + full) // row] = part.rows
        if full < grads.numel():
            self._norms[index] = Norms(norms.rows, tail_norm(grads[full:]))

    def _start_write(self, index: int, buf: _Buffer) -> None:
        """Start writing the buffer's sub-group to disk, recording its norms; the buffer is
        free once it lands."""
        self._settle_buffer(buf)
        self._norms[index] = row_norms(self._grads(buf, index))
        self._settle_write_of(index)  # two writes of one extent in flight could land reversed
        buf.future = self._submit("write", buf, index)
        buf.written = index

    def _start_read(self, index: int, buf: _Buffer, *, wait: bool = False) -> None:
        self._settle_buffer(buf)
        self._settle_write_of(index)
        buf.future = self._submit("read", buf, index)
        if wait:
            self._settle_buffer(buf)

    def _settle_write_of(self, index: int) -> None:
        for buf in self._buffers:
            if buf.written == index:
                self._settle_buffer(buf)

    def _settle_buffer(self, buf: _Buffer) -> None:
        """Wait for the buffer's transfer in flight, if any."""
        fut, buf.future, buf.written = buf.future, None, None
        if fut is not None:
            fut.wait()  # a failure marks the tier failed (ExtentIO) and raises NvmeGradError

    def _submit(self, op: str, buf: _Buffer, index: int) -> Transfer:
        ext = self._extents[index]
        start = self.io.write if op == "write" else self.io.read
        what = f"gradients of sub-group {index}"
        return start(buf.data[: ext.padded_nbytes], ext.path, ext.offset, what=what)

    def _check_usable(self, op: str) -> None:
        if self._closed:
            raise NvmeGradError(f"{op}: the NVMe gradient tier at {self.store.dir} is closed")
        self.io.check_usable(op)


class _Apply:
    """Carries out the plan's decisions with the tier's buffers and transfers (a
    `GradSink`)."""

    __slots__ = ("tier",)

    def __init__(self, tier: NvmeGradTier) -> None:
        self.tier = tier

    def zero(self, g: int, b: int) -> None:
        buf = self.tier._buffers[b]
        self.tier._settle_buffer(buf)
        self.tier._grads(buf, g).zero_()

    def load(self, g: int, b: int) -> None:
        self.tier._start_read(g, self.tier._buffers[b], wait=True)

    def landed(self, g: int, b: int) -> None:
        self.tier._settle_buffer(self.tier._buffers[b])

    def write(self, g: int, b: int) -> None:
        self.tier._start_write(g, self.tier._buffers[b])

    def read(self, g: int, b: int) -> None:
        self.tier._start_read(g, self.tier._buffers[b])

    def free(self, g: int, b: int) -> None:
        self.tier._settle_buffer(self.tier._buffers[b])
