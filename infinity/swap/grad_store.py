"""Where the fp32 gradient partitions live between backward and the optimizer step.

A grad store holds, for each optimizer sub-group, the fp32 sum of the gradients since the
last step. `HostGradStore` keeps all of them in one flat host buffer (4 bytes per trainable
element). `NvmeGradStore` keeps a few sub-groups in host buffers and the rest on disk, so its
RAM is `GRAD_BUFFERS` x the sub-group size whatever the model size. It owns the buffers, the
disk extents (kind "grad") and the sums of squares the global norm is made of; it does not
know what the optimizer computes from them.

[Note: spilled gradients] Backward reaches the sub-groups roughly from the last to the first,
so a sub-group is filled while it is one of the most recently used and written to disk once
it drops out of them (read back and added to at the next micro-step of an accumulation
window, the read of the sub-group below starting while backward fills the current one).
Every write records the norms of what it wrote by rows of 4096 elements, so at the step the
global norm is the in-order sum of one value per sub-group made from them, without reading
the gradients: the host store computes the same rows the same way, and the two give bitwise
the same norm. A small gradient (at most 1/`PARTIAL_FRACTION` of its sub-group, e.g. a
layer's norm weights, reached in backward after the rest of its layer) added to a sub-group
on disk is added there: only the rows it touches are read, added to, re-measured and written
back. The step takes the sub-groups in order (`take`), reading ahead into the free buffers,
and `release` forgets each one once stepped: a released sub-group reads as zeros without any
I/O.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from infinity.io.aio import aligned_empty
from infinity.io.extent import ExtentError, ExtentIO, Transfer
from infinity.swap.store import SwapStore, align_up

logger = logging.getLogger(__name__)

KIND = "grad"
GRAD_BUFFERS = 3
"""Host buffers of `NvmeGradStore` by default: two sub-groups being filled by backward (the
one a layer's gradients straddle into, and the one before it) and one being written."""
_F32 = 4
PARTIAL_FRACTION = 16
"""A gradient of at most 1/this of its sub-group, added while the sub-group is on disk, is
added there (its rows read, added to and written back) instead of loading the sub-group: a
layer's norm weights, reached in backward after the layer's other sub-groups were written."""
_NORM_ROW_NUMEL = 4096  # see [Note: accurate norms]
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
    tail = torch.linalg.vector_norm(flat[rows:]) if rows < flat.numel() else None
    return Norms(norms, tail)


def sum_from_norms(norms: Norms) -> float:
    total = torch.zeros((), dtype=torch.float64)
    if norms.rows.numel():
        total += norms.rows.double().square().sum()
    if norms.tail is not None:
        total += norms.tail.double().square()
    return float(total.item())


def sum_of_squares(flat: torch.Tensor) -> float:
    """Sum of squares of a flat fp32 tensor, computed in fp64 (inf/NaN propagate).

    [Note: accurate norms] One fp32 `vector_norm` over 1e8 elements came out 1% low on this
    machine (its accumulators grow too large to add small terms). Rows of `_NORM_ROW_NUMEL`
    reduced in fp32, then summed in fp64, are within 1e-8 and faster (one pass, better
    vectorized); see benchmarks/zero_optimizer_bench.py for the step's timings.
    """
    return sum_from_norms(row_norms(flat))


def grad_buffers(numels: Sequence[int], buffer_count: int = GRAD_BUFFERS) -> tuple[int, int]:
    """`NvmeGradStore`'s host buffers for sub-groups of `numels`: (count, bytes of each)."""
    return min(buffer_count, max(len(numels), 1) + 1), align_up(max(numels, default=1) * _F32)


class HostGradStore:
    """Every sub-group's gradient in one flat host buffer, allocated at first use."""

    def __init__(self, numels: Sequence[int]) -> None:
        self.numels = list(numels)
        self._starts = [0]
        for n in self.numels:
            self._starts.append(self._starts[-1] + n)
        self._flat: torch.Tensor | None = None

    @property
    def flat(self) -> torch.Tensor:
        """All sub-groups back to back: [sum(numels)] fp32."""
        if self._flat is None:
            self._flat = torch.zeros(self._starts[-1], dtype=torch.float32)
        return self._flat

    def _view(self, index: int) -> torch.Tensor:
        return self.flat[self._starts[index] : self._starts[index + 1]]

    def add(self, index: int, start: int, src: torch.Tensor) -> None:
        """Elements [start, start + src.numel()) of sub-group `index` += src."""
        add_into(self._view(index)[start : start + src.numel()], src)

    def sums_of_squares(self) -> list[float]:
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

    def close(self) -> None:
        """Nothing outstanding."""

    def memory_stats(self) -> dict[str, int]:
        return {"grad_host_bytes": 0 if self._flat is None else self._flat.nbytes}


class GradResidency(enum.Enum):
    """Where a sub-group's gradient sum is."""

    ZERO = "nothing since the last step: no buffer, no disk read; reads as zeros"
    HOST = "in a host buffer (the latest sum)"
    READING = "being read ahead into a host buffer for the step"
    ON_NVME = "the disk extent holds the latest sum (its write may still be in flight)"


class NvmeGradError(ExtentError):
    """A gradient transfer to or from NVMe failed; the store refuses further use."""


ADVICE = (
    "This step's gradients are lost; free space or fix the disk, then resume from the last "
    "checkpoint"
)


@dataclass(eq=False, slots=True)
class _Buffer:
    data: torch.Tensor
    """uint8, page-aligned, the largest sub-group's padded bytes."""
    owner: int | None = None
    """The sub-group it holds (HOST or READING), None when free."""
    future: Transfer | None = None
    """The write from it (owner None) or the read into it (owner READING) in flight."""
    written: int | None = None
    """The sub-group `future` writes, so a read of it waits for the write first."""
    used: int = field(default=0)
    """Tick of the last use (least recently used is written out first)."""


class NvmeGradStore:
    """Gradient sums on NVMe with `buffer_count` host buffers (see [Note: spilled gradients]).

    `aio` is an `AioHandle` (shared, not closed here) or an `AioConfig` (a handle is made and
    owned). `checksums` checks every read against what was written (see [Note: extent
    checksums] in infinity/io/checksum.py). Not thread-safe: the gradient hooks and the step
    run on one thread.
    """

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
        if buffer_count < 2:
            raise ValueError(
                f"the NVMe gradient store needs at least 2 host buffers (one filled while "
                f"another is written), got {buffer_count}"
            )
        self.numels = list(numels)
        self.store = store
        self.io = ExtentIO(
            aio, tier="grad", error=NvmeGradError, advice=ADVICE, checksums=checksums
        )
        self.aio = self.io.aio
        sizes = {f"subgroup.{g}": n * _F32 for g, n in enumerate(self.numels)}
        self._extents = list(store.reserve(kind, sizes).values()) if sizes else []
        count, nbytes = grad_buffers(self.numels, buffer_count)
        self._buffers = [_Buffer(aligned_empty(nbytes, torch.uint8)) for _ in range(count)]
        self.residency = [GradResidency.ZERO] * len(self.numels)
        self._norms: list[Norms | None] = [None] * len(self.numels)  # of the disk copy
        self._where: dict[int, _Buffer] = {}  # sub-group -> its buffer (HOST or READING)
        self._tick = 0
        self.stats = self.io.stats
        self._closed = False

    # -- backward --------------------------------------------------------------------------

    def add(self, index: int, start: int, src: torch.Tensor) -> None:
        """Elements [start, start + src.numel()) of sub-group `index` += src."""
        self._check_usable("add")
        if self.residency[index] is GradResidency.ON_NVME and src.numel() <= self._partial_limit(
            index
        ):
            self._add_on_disk(index, start, src)
            return
        buf = self._resident(index)
        add_into(self._grads(buf, index)[start : start + src.numel()], src)
        writing = None
        if not any(b.owner is None for b in self._buffers):  # keep one free: see GRAD_BUFFERS
            writing = self._least_recent(but=buf)
            self._evict(writing)
        self._read_behind(index - 1, current=buf, writing=writing)

    # -- the step --------------------------------------------------------------------------

    def sums_of_squares(self) -> list[float]:
        """One value per sub-group, in order: recorded when written, computed for those in
        host buffers (see [Note: spilled gradients])."""
        self._check_usable("sums_of_squares")
        out = []
        for g, state in enumerate(self.residency):
            if state is GradResidency.ZERO:
                out.append(0.0)
            elif state is GradResidency.HOST:
                out.append(sum_of_squares(self._grads(self._where[g], g)))
            else:
                out.append(sum_from_norms(self._norms[g]))
        return out

    def take(self, index: int) -> torch.Tensor:
        """Sub-group `index`'s gradient for the step, then reads of the following sub-groups
        start into the free buffers."""
        self._check_usable("take")
        buf = self._resident(index)
        self._read_ahead(index + 1)
        return self._grads(buf, index)

    def release(self, index: int) -> None:
        """The step is done with sub-group `index`: its buffer is free, it reads as zeros."""
        buf = self._where.pop(index, None)
        if buf is not None:
            self._settle_buffer(buf)
            buf.owner = None
        self.residency[index] = GradResidency.ZERO

    def zero(self) -> None:
        """Forget every gradient (a skipped step): no I/O, the reads ahead are waited for."""
        for g in list(self._where):
            self.release(g)
        self.residency = [GradResidency.ZERO] * len(self.numels)

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
        return buf.data[: self.numels[index] * _F32].view(torch.float32)

    def _resident(self, index: int) -> _Buffer:
        """Sub-group `index` in a host buffer (loaded, zeroed or waited for), most recent."""
        self._tick += 1
        state = self.residency[index]
        if state is GradResidency.HOST:
            buf = self._where[index]
        elif state is GradResidency.READING:
            buf = self._where[index]
            self._settle_buffer(buf)
            self.residency[index] = GradResidency.HOST
        else:
            buf = self._acquire()
            if state is GradResidency.ZERO:
                self._grads(buf, index).zero_()
            else:
                self._settle_write_of(index)
                buf.future = self._submit("read", buf, index)
                self._settle_buffer(buf)
            buf.owner = index
            self._where[index] = buf
            self.residency[index] = GradResidency.HOST
        buf.used = self._tick
        return buf

    def _partial_limit(self, index: int) -> int:
        return self.numels[index] // PARTIAL_FRACTION

    def _add_on_disk(self, index: int, start: int, src: torch.Tensor) -> None:
        """A small add to a sub-group on disk: read-add-write of the norm rows it touches
        only, and those rows' norms updated (see [Note: spilled gradients])."""
        n, row = self.numels[index], _NORM_ROW_NUMEL
        lo = start // row * row
        hi = min(-(-(start + src.numel()) // row) * row, n)
        ext = self._extents[index]
        data = aligned_empty(align_up((hi - lo) * _F32), torch.uint8)
        grads = data[: (hi - lo) * _F32].view(torch.float32)
        self._settle_write_of(index)
        what = f"gradients of sub-group {index}"
        self.io.read(data, ext.path, ext.offset + lo * _F32, what=what).wait()
        add_into(grads[start - lo : start - lo + src.numel()], src)
        self._update_norms(index, lo, grads)
        self.io.write(data, ext.path, ext.offset + lo * _F32, what=what).wait()

    def _update_norms(self, index: int, lo: int, grads: torch.Tensor) -> None:
        norms, row = self._norms[index], _NORM_ROW_NUMEL
        full = grads.numel() // row * row
        if lo + full > norms.rows.numel() * row:  # the range ends in the tail
            full = norms.rows.numel() * row - lo
        if full:
            part = row_norms(grads[:full])
            norms.rows[lo // row : (lo + full) // row] = part.rows
        if full < grads.numel():
            self._norms[index] = Norms(norms.rows, torch.linalg.vector_norm(grads[full:]))

    def _least_recent(self, but: _Buffer | None = None) -> _Buffer:
        held = [b for b in self._buffers if b is not but and b.owner is not None]
        held = [b for b in held if self.residency[b.owner] is GradResidency.HOST]
        assert held, "every buffer is being read ahead"  # reads ahead never take the last
        return min(held, key=lambda b: b.used)

    def _acquire(self) -> _Buffer:
        """A free buffer whose last write has landed (the oldest-finished first)."""
        free = [b for b in self._buffers if b.owner is None]
        if not free:
            self._evict(self._least_recent())
            free = [b for b in self._buffers if b.owner is None]
        done = [b for b in free if b.future is None or b.future.done()]
        buf = (done or free)[0]
        self._settle_buffer(buf)
        return buf

    def _evict(self, buf: _Buffer) -> None:
        """Start writing the buffer's sub-group to disk; the buffer is free once it lands."""
        index = buf.owner
        assert index is not None and self.residency[index] is not GradResidency.READING
        self._settle_buffer(buf)
        self._norms[index] = row_norms(self._grads(buf, index))
        self._settle_write_of(index)  # two writes of one extent in flight could land reversed
        buf.future = self._submit("write", buf, index)
        buf.written, buf.owner = index, None
        del self._where[index]
        self.residency[index] = GradResidency.ON_NVME

    def _read_ahead(self, first: int) -> None:
        """Reads of the sub-groups on disk from `first` on, into free buffers that need no
        waiting; stops at the first one no buffer is free for."""
        for g in range(first, len(self.numels)):
            if self.residency[g] is GradResidency.ON_NVME and not self._read_into_free(g):
                return

    def _read_behind(self, index: int, *, current: _Buffer, writing: _Buffer | None) -> None:
        """Backward goes down the sub-groups: from the second micro-step of a window on, the
        one below is on disk, so its read starts while this one fills, when a buffer is
        free and another (free, or filled and not `current`) is left to write out next.

        The read takes a free buffer other than `writing` (the one this add started writing
        out), waiting for an earlier add's write from it if that has not landed: whether the
        read starts depends on the adds alone, never on the disk's timing, so every step
        moves the same bytes (which `infinity.estimate.grad_traffic` replays)."""
        if index < 0 or self.residency[index] is not GradResidency.ON_NVME:
            return
        spare = [
            b
            for b in self._buffers
            if b.owner is None
            or (b is not current and self.residency[b.owner] is GradResidency.HOST)
        ]
        if len(spare) >= 2:
            free = [b for b in self._buffers if b.owner is None and b is not writing]
            if free:
                self._start_read(index, free[0])

    def _read_into_free(self, index: int) -> bool:
        """Start reading sub-group `index` into a free buffer that needs no waiting."""
        free = [
            b for b in self._buffers if b.owner is None and (b.future is None or b.future.done())
        ]
        if not free:
            return False
        self._start_read(index, free[0])
        return True

    def _start_read(self, index: int, buf: _Buffer) -> None:
        self._settle_buffer(buf)
        self._settle_write_of(index)
        buf.future = self._submit("read", buf, index)
        buf.owner = index
        self._where[index] = buf
        self.residency[index] = GradResidency.READING

    def _settle_write_of(self, index: int) -> None:
        for buf in self._buffers:
            if buf.written == index:
                self._settle_buffer(buf)

    def _settle_buffer(self, buf: _Buffer) -> None:
        """Wait for the buffer's transfer in flight, if any."""
        fut, buf.future, buf.written = buf.future, None, None
        if fut is not None:
            fut.wait()  # a failure marks the store failed (ExtentIO) and raises NvmeGradError

    def _submit(self, op: str, buf: _Buffer, index: int) -> Transfer:
        ext = self._extents[index]
        start = self.io.write if op == "write" else self.io.read
        what = f"gradients of sub-group {index}"
        return start(buf.data[: ext.padded_nbytes], ext.path, ext.offset, what=what)

    def _check_usable(self, op: str) -> None:
        if self._closed:
            raise NvmeGradError(f"{op}: the NVMe gradient store at {self.store.dir} is closed")
        self.io.check_usable(op)
