"""The NVMe gradient store's bytes for one optimizer step, replayed without tensors.

`NvmeGradTier` (infinity/swap/grad_tier.py) decides what to write, read back and add on
disk from the order backward adds the gradients in (see [Note: spilled gradients] there).
`grad_traffic` runs that policy (`infinity.swap.grad_plan`, the plan the store applies)
on the sizes alone, counting bytes: backward reaches the gathering units
in reverse forward order (a unit's parameters last to first), each parameter's gradient is
added one sub-group piece at a time, `accum` micro-steps, then the step takes and releases
every sub-group in order. Each step starts with every sub-group released, so every step
moves the same bytes. A write is taken as in flight during the add that started it and
finished from the next add on (so a read behind never takes the buffer just written from);
on a disk slower than that a read behind may start later, which changes the bytes only when
a small add then lands on disk instead of in a buffer.

It also counts what backward waits for: an add to a sub-group on disk that was not read
ahead loads it into a buffer, or (a small add) reads, adds to and writes back the rows it
touches, each after the sub-group's last write has landed, all while the add waits. Those
bytes cost backward their transfer time on top of its compute (the writes out of buffers
and the reads behind run while it computes; a buffer whose write has not landed when it is
needed again is not counted: on a fast disk it has).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from infinity.estimate.shapes import ModelShape
from infinity.swap.grad_plan import FP32_NBYTES, GradPlan, disk_rows
from infinity.swap.store import align_up, reserved_nbytes
from infinity.zero.sub_groups import FlatLayout


def backward_slots(shape: ModelShape) -> list[int]:
    """Trainable slots in the order backward accumulates their gradients."""
    slot, n = {}, 0
    for i, p in enumerate(shape.params):
        if p.trainable:
            slot[i], n = n, n + 1
    order: list[int] = []
    for unit in reversed(shape.units):
        for i in reversed(unit.params):
            if i in slot:
                order.append(slot[i])
    last = {s: k for k, s in enumerate(order)}  # a shared parameter: its first forward use
    return [s for k, s in enumerate(order) if last[s] == k]


class _GradSink:
    """A sink for the store's plan that counts bytes instead of moving them; a write is in
    flight during the add that started it (see the module's note)."""

    def __init__(self, numels: Sequence[int]) -> None:
        self.padded = [reserved_nbytes(n * FP32_NBYTES) for n in numels]
        self.writing: set[int] = set()
        """Buffers a write started from in this add."""
        self.backward = True
        self.nbytes_read = self.nbytes_written = 0
        self.waited_read = self.waited_written = 0
        """Of the bytes read and written, those an add waits for (see the module's note)."""
        self.landing: dict[int, int] = {}
        """Sub-group -> bytes of its last write, until something waits for it."""

    def idle(self, b: int) -> bool:
        return b not in self.writing

    def zero(self, g: int, b: int) -> None:
        pass

    def load(self, g: int, b: int) -> None:
        self.nbytes_read += self.padded[g]
        if self.backward:  # loaded while the add waits
            self.waited_read += self.padded[g]
            self.waited_written += self.landing.pop(g, 0)

    def landed(self, g: int, b: int) -> None:
        pass

    def write(self, g: int, b: int) -> None:
        self.nbytes_written += self.padded[g]
        self.landing[g] = self.padded[g]
        self.writing.add(b)

    def read(self, g: int, b: int) -> None:
        self.nbytes_read += self.padded[g]

    def free(self, g: int, b: int) -> None:
        pass

    def add_on_disk(self, g: int, numel: int, start: int, stop: int) -> None:
        """An add of [start, stop) to `g` on disk: the norm rows it touches, read, added to
        and written back while the add waits."""
        lo, hi = disk_rows(start, stop - start, numel)
        nbytes = align_up((hi - lo) * FP32_NBYTES)
        self.nbytes_read += nbytes
        self.nbytes_written += nbytes
        self.waited_read += nbytes
        self.waited_written += nbytes + self.landing.pop(g, 0)


class GradTraffic(NamedTuple):
    """Bytes the NVMe gradient store moves in one optimizer step."""

    read: int
    written: int
    step_read: int
    """Of `read`, what the optimizer step reads (`take`); the rest is read in backward."""
    backward_waited_read: int = 0
    """Of the bytes read in backward, those an add waits for (see the module's note)."""
    backward_waited_written: int = 0
    """Of the bytes written in backward, those an add waits for."""


def grad_traffic(shape: ModelShape, layout: FlatLayout, accum: int, first: int = 0) -> GradTraffic:
    """The NVMe gradient store's bytes in one optimizer step of `accum` micro-steps: its
    plan (`GradPlan`) driven by backward's adds, then the step's takes and releases. The
    store holds the sub-groups from `first` on (those before stay in RAM: `SplitGradTier`),
    numbered from 0 in it."""
    numels = layout.sub_group_numels[first:]
    plan = GradPlan(numels)
    sink = _GradSink(numels)
    order = backward_slots(shape)
    for _ in range(accum):
        for i in order:
            lo = layout.offsets[i]
            hi = lo + layout.numels[i]
            for sub in layout.sub_groups_of(i):
                if sub < first:
                    continue  # a host buffer: no transfer
                start, stop = layout.range(sub)
                g = sub - first
                a, b = max(lo, start) - start, min(hi, stop) - start
                sink.writing.clear()  # writes started by earlier adds have landed
                if plan.on_disk(g, b - a):
                    sink.add_on_disk(g, numels[g], a, b)
                else:
                    plan.added(g, plan.add(g, sink, sink.idle), sink)
    backward_read = sink.nbytes_read
    sink.backward = False
    for g in range(len(numels)):
        plan.take(g, sink, sink.idle)
        plan.release(g, sink)
    return GradTraffic(
        sink.nbytes_read,
        sink.nbytes_written,
        sink.nbytes_read - backward_read,
        sink.waited_read,
        sink.waited_written,
    )
