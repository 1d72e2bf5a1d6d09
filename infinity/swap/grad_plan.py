"""The NVMe gradient tier's buffer policy: which sub-group sits in which host buffer, which
is written out, read back, read ahead or added to on disk.

Owns the decisions only, over plain integers (a sub-group and a buffer are indices): where
each sub-group's sum is (`GradResidency`), which buffer holds it, which buffer is written out
next (least recently used), when a read behind or ahead starts, and when a small add goes to
disk. It holds no tensors and does no I/O: a `GradSink` carries out each decision, and an
`idle(buffer)` predicate says whether a buffer's last transfer has finished (the one input
that may depend on the disk's timing). `NvmeGradTier` (infinity/swap/grad_tier.py) applies
it; the estimate (`infinity.estimate.grad_traffic`) runs it and counts bytes. The rules are
[Note: spilled gradients] in grad_tier.py.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol

from infinity.swap.footprint import Footprint
from infinity.swap.store import align_up, reserved_nbytes
from infinity.utils.sizes import FP32_BYTES

GRAD_BUFFERS = 3
"""Host buffers of `NvmeGradTier` by default: two sub-groups being filled by backward (the
one a layer's gradients straddle into, and the one before it) and one being written."""
PARTIAL_FRACTION = 16
"""A gradient of at most 1/this of its sub-group, added while the sub-group is on disk, is
added there (its rows read, added to and written back) instead of loading the sub-group: a
layer's norm weights, reached in backward after the layer's other sub-groups were written."""
NORM_ROW_NUMEL = 2048
"""Elements per row of the global norm (see [Note: the norm's order] in grad_tier.py): a
divisor of the slots' alignment (`infinity.zero.sub_groups.SLOT_ALIGN`), and what the shards
are aligned to (`infinity.zero.shard.shard_align`). A write records its norms by rows."""
DISK_ROW_NUMEL = 4096
"""Elements an add on disk reads and writes back in whole spans of (16 KiB, a multiple of the
norm's rows, whose norms it measures again): the I/O the engine has always done, which the
estimate counts."""


def disk_rows(start: int, numel: int, total: int) -> tuple[int, int]:
    """The elements [lo, hi) that an add on disk of elements [start, start + numel) of a
    sub-group of `total` elements reads, adds to and writes back: whole spans of
    `DISK_ROW_NUMEL` (the last one cut at `total`), so whole rows of the norm."""
    span = DISK_ROW_NUMEL
    return start // span * span, min(-(-(start + numel) // span) * span, total)


def grad_buffers(numels: Sequence[int], buffer_count: int = GRAD_BUFFERS) -> tuple[int, int]:
    """`NvmeGradTier`'s host buffers for sub-groups of `numels`: (count, bytes of each)."""
    return min(buffer_count, max(len(numels), 1) + 1), align_up(max(numels, default=1) * FP32_BYTES)


def grad_footprint(
    numels: Sequence[int], *, nvme: bool, buffer_count: int = GRAD_BUFFERS
) -> Footprint:
    """The gradient tier over sub-groups of `numels`: `HostGradTier`'s flat fp32 buffer,
    or `NvmeGradTier`'s `grad_buffers` and its extents (one fp32 sub-group each)."""
    if not nvme:
        return Footprint(FP32_BYTES * sum(numels))
    count, nbytes = grad_buffers(numels, buffer_count)
    return Footprint(count * nbytes, sum(reserved_nbytes(n * FP32_BYTES) for n in numels))


class GradResidency(enum.Enum):
    """Where a sub-group's gradient sum is."""

    ZERO = "nothing since the last step: no buffer, no disk read; reads as zeros"
    HOST = "in a host buffer (the latest sum)"
    READING = "being read ahead into a host buffer for the step"
    ON_NVME = "the disk extent holds the latest sum (its write may still be in flight)"


class GradSink(Protocol):
    """Carries out the plan's decisions on sub-group `g` and buffer `b`."""

    def zero(self, g: int, b: int) -> None:
        """Buffer `b` now holds sub-group `g` as zeros."""

    def load(self, g: int, b: int) -> None:
        """Read `g` from disk into `b` and wait for it."""

    def landed(self, g: int, b: int) -> None:
        """The read of `g` ahead into `b` is needed now: wait for it."""

    def write(self, g: int, b: int) -> None:
        """Start writing `b` as `g`'s disk copy; `b` is free once it lands."""

    def read(self, g: int, b: int) -> None:
        """Start reading `g` into `b` (a read behind or ahead)."""

    def free(self, g: int, b: int) -> None:
        """The step is done with `g`: `b` holds nothing from now on."""


Idle = Callable[[int], bool]
"""Whether a buffer's last transfer has finished (a free buffer that needs no waiting)."""


class GradPlan:
    """The residency of every sub-group of `numels` and the owner of each of the
    `grad_buffers` host buffers."""

    def __init__(self, numels: Sequence[int], buffer_count: int = GRAD_BUFFERS) -> None:
        if buffer_count < 2:
            raise ValueError(
                f"the NVMe gradient tier needs at least 2 host buffers (one filled while "
                f"another is written), got {buffer_count}"
            )
        self.numels = list(numels)
        count, _ = grad_buffers(self.numels, buffer_count)
        self.owner: list[int | None] = [None] * count
        """The sub-group each buffer holds (HOST or READING), None when free."""
        self.used = [0] * count
        """Tick of each buffer's last use (least recently used is written out first)."""
        self.residency = [GradResidency.ZERO] * len(self.numels)
        self.where: dict[int, int] = {}
        """Sub-group -> its buffer (HOST or READING)."""
        self._tick = 0

    # -- backward --------------------------------------------------------------------------

    def on_disk(self, g: int, numel: int) -> bool:
        """Whether an add of `numel` elements to `g` goes to disk, rows only (`g` is on
        disk and the add small): the caller adds there, nothing changes here."""
        return (
            self.residency[g] is GradResidency.ON_NVME
            and numel <= self.numels[g] // PARTIAL_FRACTION
        )

    def add(self, g: int, sink: GradSink, idle: Idle) -> int:
        """An add to `g` (not `on_disk`): the buffer it goes into, made resident."""
        return self._resident(g, sink, idle)

    def added(self, g: int, b: int, sink: GradSink) -> None:
        """The add into `b` is done: keep one buffer free (writing out the least recently
        used other one), and start reading the sub-group below when buffers allow (see
        `NvmeGradTier._read_behind`: this depends on the adds alone, never on timing)."""
        writing = None
        if not any(o is None for o in self.owner):
            writing = self._least_recent(but=b)
            self._evict(writing, sink)
        below = g - 1
        if below < 0 or self.residency[below] is not GradResidency.ON_NVME:
            return
        spare = [
            k
            for k, o in enumerate(self.owner)
            if o is None or (k != b and self.residency[o] is GradResidency.HOST)
        ]
        if len(spare) >= 2:
            free = [k for k, o in enumerate(self.owner) if o is None and k != writing]
            if free:
                self._start_read(below, free[0], sink)

    # -- the step --------------------------------------------------------------------------

    def take(self, g: int, sink: GradSink, idle: Idle) -> int:
        """`g` resident for the step (its buffer returned), then reads of the following
        sub-groups on disk start into free idle buffers, stopping at the first that has
        none."""
        b = self._resident(g, sink, idle)
        for h in range(g + 1, len(self.numels)):
            if self.residency[h] is not GradResidency.ON_NVME:
                continue
            free = [k for k, o in enumerate(self.owner) if o is None and idle(k)]
            if not free:
                break
            self._start_read(h, free[0], sink)
        return b

    def release(self, g: int, sink: GradSink) -> None:
        """The step is done with `g`: its buffer is free, it reads as zeros."""
        b = self.where.pop(g, None)
        if b is not None:
            sink.free(g, b)
            self.owner[b] = None
        self.residency[g] = GradResidency.ZERO

    def zero(self, sink: GradSink) -> None:
        """Forget every sum (no I/O; reads ahead are waited for through `free`)."""
        for g in list(self.where):
            self.release(g, sink)
        self.residency = [GradResidency.ZERO] * len(self.numels)

    # -- internals -------------------------------------------------------------------------

    def _resident(self, g: int, sink: GradSink, idle: Idle) -> int:
        self._tick += 1
        state = self.residency[g]
        if state is GradResidency.HOST:
            b = self.where[g]
        elif state is GradResidency.READING:
            b = self.where[g]
            sink.landed(g, b)
        else:
            b = self._acquire(sink, idle)
            if state is GradResidency.ZERO:
                sink.zero(g, b)
            else:
                sink.load(g, b)
            self.owner[b] = g
            self.where[g] = b
        self.residency[g] = GradResidency.HOST
        self.used[b] = self._tick
        return b

    def _least_recent(self, but: int | None = None) -> int:
        held = [
            k
            for k, o in enumerate(self.owner)
            if k != but and o is not None and self.residency[o] is GradResidency.HOST
        ]
        assert held, "every buffer is being read ahead"  # reads ahead never take the last
        return min(held, key=lambda k: self.used[k])

    def _acquire(self, sink: GradSink, idle: Idle) -> int:
        """A free buffer, an idle one first (writing the least recently used out if none)."""
        free = [k for k, o in enumerate(self.owner) if o is None]
        if not free:
            self._evict(self._least_recent(), sink)
            free = [k for k, o in enumerate(self.owner) if o is None]
        done = [k for k in free if idle(k)]
        return (done or free)[0]

    def _evict(self, b: int, sink: GradSink) -> None:
        g = self.owner[b]
        assert g is not None and self.residency[g] is not GradResidency.READING
        sink.write(g, b)
        self.owner[b] = None
        del self.where[g]
        self.residency[g] = GradResidency.ON_NVME

    def _start_read(self, g: int, b: int, sink: GradSink) -> None:
        sink.read(g, b)
        self.owner[b] = g
        self.where[g] = b
        self.residency[g] = GradResidency.READING
