"""The all-gather of a sharded parameter, as one transfer from its home to the device.

`ShardGather` wraps the local transfer of the rank's shard (a `Fetch` of its home) and adds
the all-gather of every rank's shard into the gathered buffer (W*S elements, the parameter
and its zero padding). It owns that buffer and the collective in flight; when to fetch and
land is the coordinator's (see [Note: gathering shards] in param.py).

[Note: early all-gathers] A host shard's transfer lands at once, so the all-gather is issued
when the fetch is (asynchronously, after the copy on the copy stream): a parameter fetched
ahead by prefetch is gathered while the modules before it compute, and landing it only
waits for the collective. An NVMe shard must first be read, and how long that takes is up
to the disk, so its all-gather is issued when it lands, which the coordinator decides from
the gathers and the trace alone. Either way the collectives follow the coordinator's
decisions, which are the same on every rank.
"""

from __future__ import annotations

import torch

from infinity.accelerator import Accelerator, Event, Stream
from infinity.comm import Comm, Work
from infinity.zero.home import Fetch


class ShardGather:
    """A `Fetch` of a whole sharded parameter: the home's shard, then the all-gather."""

    aliases_home = False  # the gathered buffer is the all-gather's own

    __slots__ = ("_inner", "_comm", "_stream", "_shard", "_copied", "_full", "_work")

    def __init__(self, inner: Fetch, comm: Comm, accel: Accelerator, stream: Stream) -> None:
        self._inner: Fetch | None = inner
        self._comm, self._stream = comm, stream
        self._shard: torch.Tensor | None = None
        self._copied: Event | None = None
        self._full: torch.Tensor | None = None
        self._work: Work | None = None
        if not inner.reading:  # see [Note: early all-gathers]
            self.finish_read(accel)
            self._start(accel, async_op=True)

    @property
    def reading(self) -> bool:
        """An NVMe read of the shard holds a pool buffer."""
        return self._inner is not None and self._inner.reading

    def done(self) -> bool:
        if self._inner is not None:
            return self._inner.done()
        return self._work is None or self._work.done()

    def finish_read(self, accel: Accelerator) -> None:
        """The local part only: land the shard in its device buffer (an NVMe read gives its
        pool buffer back). It may run whenever the read is done; the all-gather waits for
        `land`, which every rank reaches at the same point."""
        inner, self._inner = self._inner, None
        assert inner is not None
        self._shard, self._copied = inner.land(accel)

    def land(self, accel: Accelerator) -> tuple[torch.Tensor, Event]:
        """The gathered buffer, and an event after the all-gather on the compute stream."""
        if self._work is None:
            if self._inner is not None:
                self.finish_read(accel)
            self._start(accel, async_op=False)
        assert self._full is not None and self._work is not None
        self._work.wait()
        event = accel.new_event()
        event.record(accel.current_stream())
        return self._full, event

    def cancel(self) -> None:
        """Not wanted: a read gives its buffer back; an all-gather issued on every rank
        still completes."""
        if self._inner is not None:
            inner, self._inner = self._inner, None
            inner.cancel()
        elif self._work is not None:
            self._work.wait()
        self._shard = self._full = None

    def _start(self, accel: Accelerator, *, async_op: bool) -> None:
        shard, copied = self._shard, self._copied
        assert shard is not None and copied is not None
        numel = self._comm.world_size * shard.numel()
        # On the copy stream, after the shard's copy: NCCL orders its work after the
        # current stream's (gloo and the CPU have no streams).
        with accel.use_stream(self._stream):
            self._stream.wait_event(copied)
            self._full = torch.empty(numel, dtype=shard.dtype, device=shard.device)
            self._work = self._comm.all_gather_into(self._full, shard, async_op=async_op)
        self._shard = self._copied = None
