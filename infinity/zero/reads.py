"""The NVMe reads behind the coordinator's fetches: queued for pool buffers, issued in the
order decided, finished as the disk completes them.

`ReadQueue` owns what may depend on the disk's timing (see [Note: the same order on every
rank] in coordinator.py): when a decided read is issued and when a finished one is copied
to its device buffer, freeing its pool buffer for the next. Nothing here makes a parameter
LIVE or releases one; the coordinator decides both.

[Note: the NVMe pool] A parameter whose home is on NVMe is read into a buffer of the parameter
tier's fixed pool before it is copied to the device. A fetch decided for such a parameter
is queued until a buffer is free (`infinity.zero.reads.ReadQueue`); reads are issued in the
order decided, and whenever the coordinator runs (each gather) the reads that have finished
are copied to their device buffers, which frees their pool buffers for the next ones,
without waiting for the disk. A gather that needs a parameter whose read is still queued
first completes the oldest reads in flight (they were issued for units needed sooner) until
a buffer is free, so a unit with more parameters than buffers never deadlocks; only when no
read of ours holds a buffer does it block on the pool (which times out with the holders'
names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from infinity.accelerator import Accelerator, Stream
from infinity.zero.param import OffloadParam


class ReadQueue:
    """Decided NVMe reads: `queued` (waiting for a pool buffer), then `reading` (holding
    one, oldest first), then finished early or landed by the coordinator."""

    def __init__(self, accel: Accelerator, stream: Stream) -> None:
        self.accel = accel
        self.stream = stream
        self.queued: dict[OffloadParam, None] = {}
        self.reading: dict[OffloadParam, None] = {}
        self._failed: dict[OffloadParam, BaseException] = {}

    def add(self, rec: OffloadParam) -> None:
        """Queue `rec`'s read (RELEASED; issued when the pool has a buffer)."""
        self.queued[rec] = None

    def forget(self, rec: OffloadParam) -> BaseException | None:
        """`rec` lands or is released: drop it; returns the error of a read that failed
        when it was finished early (raise it where the parameter is needed)."""
        self.queued.pop(rec, None)
        self.reading.pop(rec, None)
        return self._failed.pop(rec, None)

    def pump(self, first: Iterable[OffloadParam] = ()) -> None:
        """Never waiting: finish the reads that are done, then issue queued reads (those in
        `first`, then the rest in the order queued) while the pool has buffers."""
        for rec in [r for r in self.reading if r.read_done()]:
            if not self._finish(rec):
                break  # reads that land with a collective wait for their gather
        for rec in first:
            if rec in self.queued and not self._issue(rec):
                return
        for rec in list(self.queued):
            if not self._issue(rec):
                return
            if rec.read_done():  # a fast disk (or the page cache): free the buffer at once
                self._finish(rec)

    def issue_now(self, rec: OffloadParam, land: Callable[[OffloadParam], None]) -> None:
        """`rec` is needed now: complete the oldest reads in flight (they were issued for
        units needed sooner) until the pool has a buffer for it. A read that cannot be
        finished apart from its landing is landed with `land`, at this point every rank
        reaches (with no read finished early, `reading` is the same on every rank too)."""
        while rec in self.queued and not self._issue(rec):
            if not self.reading:
                self._issue(rec, block=True)  # the pool is held elsewhere: wait for it
                return
            oldest = next(iter(self.reading))
            if not self._finish(oldest):
                land(oldest)

    def _issue(self, rec: OffloadParam, *, block: bool = False) -> bool:
        """Issue a queued read; False (still queued) when the pool has no free buffer."""
        if not rec.fetch(self.accel, self.stream, block=block):
            return False
        del self.queued[rec]
        self.reading[rec] = None
        return True

    def _finish(self, rec: OffloadParam) -> bool:
        """Copy `rec`'s read to its device buffer and free the pool buffer; it stays
        INFLIGHT. A failed read is kept for `forget`. False when it cannot be finished
        apart from its landing (nothing done)."""
        try:
            if not rec.finish_read(self.accel):
                return False
        except Exception as e:  # the read failed; rec is RELEASED with its buffer back
            self._failed[rec] = e
        del self.reading[rec]
        return True
