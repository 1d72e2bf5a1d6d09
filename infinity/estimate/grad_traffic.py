"""The NVMe gradient store's bytes for one optimizer step, replayed without tensors.

`NvmeGradStore` (infinity/swap/grad_store.py) decides what to write, read back and add on
disk from the order backward adds the gradients in (see [Note: spilled gradients] there).
`grad_traffic` replays that policy on the sizes alone: backward reaches the gathering units
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
from infinity.swap.grad_store import _F32, _NORM_ROW_NUMEL, PARTIAL_FRACTION, grad_buffers
from infinity.swap.store import align_up, reserved_nbytes
from infinity.zero.sub_groups import FlatLayout

_ZERO, _HOST, _READING, _ON_NVME = range(4)


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


class _Buf:
    __slots__ = ("owner", "used", "writing")

    def __init__(self) -> None:
        self.owner: int | None = None
        self.used = 0
        self.writing = False
        """A write out of it started in this add: not finished when the add looks."""


class _Replay:
    """`NvmeGradStore`'s residency and buffer policy, counting bytes instead of moving them."""

    def __init__(self, numels: Sequence[int]) -> None:
        self.numels = list(numels)
        self.padded = [reserved_nbytes(n * _F32) for n in self.numels]
        count, _ = grad_buffers(self.numels)
        self.bufs = [_Buf() for _ in range(count)]
        self.res = [_ZERO] * len(self.numels)
        self.where: dict[int, _Buf] = {}
        self.tick = 0
        self.read = self.written = 0
        self.waited_read = self.waited_written = 0
        """Of `read` and `written`, the bytes an add waits for (see the module's note)."""
        self._landing: dict[int, int] = {}
        """Sub-group -> bytes of its last write, until something waits for it."""

    def add(self, index: int, start: int, numel: int) -> None:
        for b in self.bufs:  # writes started by earlier adds have landed
            b.writing = False
        if self.res[index] == _ON_NVME and numel <= self.numels[index] // PARTIAL_FRACTION:
            row = _NORM_ROW_NUMEL
            lo = start // row * row
            hi = min(-(-(start + numel) // row) * row, self.numels[index])
            nbytes = align_up((hi - lo) * _F32)
            self.read += nbytes
            self.written += nbytes
            self.waited_read += nbytes
            self.waited_written += nbytes + self._landing.pop(index, 0)
            return
        if self.res[index] == _ON_NVME:  # loaded while the add waits
            self.waited_read += self.padded[index]
            self.waited_written += self._landing.pop(index, 0)
        buf = self._resident(index)
        if not any(b.owner is None for b in self.bufs):
            self._evict(self._least_recent(but=buf))
        self._read_behind(index - 1, current=buf)

    def take(self, index: int) -> None:
        self._resident(index)
        for g in range(index + 1, len(self.numels)):
            if self.res[g] == _ON_NVME and not self._read_into_free(g):
                break

    def release(self, index: int) -> None:
        buf = self.where.pop(index, None)
        if buf is not None:
            buf.owner = None
        self.res[index] = _ZERO

    def _resident(self, index: int) -> _Buf:
        self.tick += 1
        state = self.res[index]
        if state in (_HOST, _READING):
            buf = self.where[index]
        else:
            buf = self._acquire()
            if state == _ON_NVME:
                self.read += self.padded[index]
            buf.owner = index
            self.where[index] = buf
        self.res[index] = _HOST
        buf.used = self.tick
        return buf

    def _least_recent(self, but: _Buf | None = None) -> _Buf:
        held = [b for b in self.bufs if b is not but and b.owner is not None]
        return min((b for b in held if self.res[b.owner] == _HOST), key=lambda b: b.used)

    def _acquire(self) -> _Buf:
        free = [b for b in self.bufs if b.owner is None]
        if not free:
            self._evict(self._least_recent())
            free = [b for b in self.bufs if b.owner is None]
        return free[0]

    def _evict(self, buf: _Buf) -> None:
        index = buf.owner
        self.written += self.padded[index]
        self._landing[index] = self.padded[index]
        buf.owner, buf.writing = None, True
        del self.where[index]
        self.res[index] = _ON_NVME

    def _read_behind(self, index: int, *, current: _Buf) -> None:
        if index < 0 or self.res[index] != _ON_NVME:
            return
        spare = [
            b
            for b in self.bufs
            if b.owner is None or (b is not current and self.res[b.owner] == _HOST)
        ]
        if len(spare) >= 2:
            self._read_into_free(index)

    def _read_into_free(self, index: int) -> bool:
        free = [b for b in self.bufs if b.owner is None and not b.writing]
        if not free:
            return False
        free[0].owner = index
        self.where[index] = free[0]
        self.res[index] = _READING
        self.read += self.padded[index]
        return True


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


def grad_traffic(shape: ModelShape, layout: FlatLayout, accum: int) -> GradTraffic:
    """The NVMe gradient store's bytes in one optimizer step of `accum` micro-steps."""
    replay = _Replay(layout.sub_group_numels)
    order = backward_slots(shape)
    for _ in range(accum):
        for i in order:
            lo = layout.offsets[i]
            hi = lo + layout.numels[i]
            for g in layout.sub_groups_of(i):
                start, stop = layout.range(g)
                a, b = max(lo, start), min(hi, stop)
                replay.add(g, a - start, b - a)
    backward_read = replay.read
    waited = (replay.waited_read, replay.waited_written)
    for g in range(layout.num_sub_groups):
        replay.take(g)
        replay.release(g)
    return GradTraffic(replay.read, replay.written, replay.read - backward_read, *waited)
