"""Gradients across ranks: the full device gradients, reduce-scattered in buckets into each
rank's fp32 gradient slots.

`GradReducer` owns the buckets between the gradient hooks and the optimizer's
`accumulate_grad`: their buffers, the reductions in flight and the end of a backward. It
does not own the slots (the optimizer does) nor decide when a gradient is ready (autograd's
post-accumulate hooks do, see `install_grad_hooks`). Used only with more than one rank: a
single process adds each gradient straight into its slot.

[Note: gradient buckets] Rank r's slot holds the S elements of its shard (see
`infinity.zero.shard`). A bucket is laid out rank-major: row q holds, for each of the
bucket's parameters in hook order, elements [q*S, (q+1)*S) of its gradient (zero past N), so
one reduce-scatter (sum) of the bucket leaves in each rank exactly its shards of all of them,
back to back. The sum is divided by W (the gradient of the mean loss over the global batch)
and added into the slots. A bucket holds up to `reduce_bucket_size` elements (W rows of
reduce_bucket_size / W); a parameter larger than that is a bucket of its own. With
`contiguous_gradients` each gradient is copied into its bucket's buffer in the hook and the
device gradient is freed at once; otherwise the gradients are kept until the bucket is
issued and copied then. With `overlap_comm` a full bucket's reduce-scatter runs while
backward goes on (two buffers, the older reduction is waited for when a third is needed);
otherwise backward waits for each one. Every rank fills the buckets in the same hook order
(the same graph), so the collectives match; the end of each backward (an autograd callback
queued by the first gradient) issues the last, partial bucket and waits for all of them.

The buckets are in the communication dtype (`Config.communication_dtype`: DeepSpeed's
`communication_data_type`, the training dtype where it is null); each gradient is cast into
its bucket by the copy that lays it out, in the hook or at the issue, so every mode above
reduces in that dtype. The division by W and the add into the fp32 slots do not depend on
it. It decides the bits with 16-bit gradients. One rank accumulating two micro batches
backpropagates each at half the loss (the loss is divided by the accumulation) and adds the
16-bit gradients a/2 and b/2 into its fp32 sums; two ranks backpropagate one each, sum
a + b and halve it. In fp32 buckets that sum is the same one fp32 addition and the halving
is exact, so two ranks equal one bit for bit wherever each 16-bit gradient at half the
loss is exactly half the one at the whole loss: in bf16 (whose range holds any gradient),
and in fp16 unless a scaled gradient is subnormal (halving one drops its last bit; with
the accumulating rank's loss scale twice as large both compute the same fp16 gradients,
which is how tests/test_dist_engine.py compares fp16 bit for bit). In 16-bit buckets the
sum is rounded to 16 bits first, an error one rank never makes. "fp32" costs twice the
bucket memory and reduce-scatter bytes of a 16-bit dtype (`comm_reduce_scatter_bytes`
counts the buffers).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from infinity.accelerator import Accelerator
from infinity.comm import Comm, Work
from infinity.zero.backward_end import OnceAtBackwardEnd
from infinity.zero.shard import shard_of


@dataclass(slots=True)
class _BucketSlot:
    slot: int
    numel: int
    """N: the parameter's elements."""
    shard: int
    """S: elements of each rank's row."""
    offset: int
    """Where its shard starts in each row."""
    grad: torch.Tensor | None = None
    """The device gradient, kept until the bucket is issued (without contiguous_gradients)."""


@dataclass(slots=True)
class _Bucket:
    dtype: torch.dtype
    capacity: int
    """Elements per row of `buffer` (its rows' stride)."""
    buffer: torch.Tensor | None
    """[W, capacity] on the device with contiguous_gradients, else None until issued."""
    pooled: bool
    entries: list[_BucketSlot] = field(default_factory=list)
    row_numel: int = 0
    out: torch.Tensor | None = None
    work: Work | None = None


class GradReducer:
    """Bucketed reduce-scatter of full device gradients into the optimizer's slots (see
    [Note: gradient buckets]). `accumulate(slot, host_grad)` adds S fp32 elements."""

    def __init__(
        self,
        comm: Comm,
        accumulate: Callable[[int, torch.Tensor], None],
        accelerator: Accelerator,
        *,
        bucket_numel: int,
        overlap: bool,
        contiguous: bool,
        total_shard_numel: int,
        on_device: Collection[int] = (),
        align: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        if bucket_numel < 1:
            raise ValueError(f"reduce_bucket_size must be >= 1 element, got {bucket_numel}")
        self.comm = comm
        self.world_size = comm.world_size
        self.align = align  # the shards' (infinity.zero.shard.shard_align)
        self.accumulate = accumulate
        self.on_device = frozenset(on_device)
        """Slots whose sums are on the device: a bucket of only those is added there."""
        self.accel = accelerator
        self.overlap = overlap
        self.contiguous = contiguous
        self.dtype = dtype
        """The buckets' dtype, each gradient cast into it; None: each gradient's own."""
        self.row_capacity = bucket_row_numel(bucket_numel, self.world_size, total_shard_numel)
        self._open: _Bucket | None = None
        self._in_flight: deque[_Bucket] = deque()
        self._buffers: list[torch.Tensor] = []  # free pooled [W, row_capacity] buffers
        self._pool_size = 2 if overlap else 1
        self._allocated = 0
        self._pooled_bytes = 0
        self._at_end = OnceAtBackwardEnd(self.flush)
        self.buckets_issued = 0

    def add(self, slot: int, grad: torch.Tensor) -> None:
        """Take slot `slot`'s full device gradient (flat, N elements) into a bucket; issue
        the bucket when full."""
        self._at_end.arm()  # the end of this backward flushes the rest
        n = grad.numel()
        s = shard_of(n, self.world_size, 0, self.align).numel
        dtype = self.dtype or grad.dtype
        bucket = self._open
        if bucket is not None and (bucket.row_numel + s > bucket.capacity or bucket.dtype != dtype):
            self._issue(bucket)
            bucket = None
        if bucket is None:
            bucket = self._open = self._new_bucket(dtype, grad.device, s)
        entry = _BucketSlot(slot, n, s, bucket.row_numel)
        bucket.entries.append(entry)
        bucket.row_numel += s
        if bucket.buffer is not None:
            _scatter_rows(bucket.buffer, entry, grad)
        else:
            entry.grad = grad
        if bucket.row_numel == bucket.capacity:
            self._issue(bucket)

    def flush(self) -> None:
        """Issue the open bucket and wait for every reduction: all gradients of the
        backward are in the slots on return. Every rank calls it at the same point."""
        self._at_end.disarm()
        if self._open is not None:
            self._issue(self._open)
        while self._in_flight:
            self._complete(self._in_flight.popleft())

    def memory_stats(self) -> dict[str, int]:
        """Device bytes of the pooled bucket buffers (allocated once, reused)."""
        return {"grad_bucket_bytes": self._pooled_bytes}

    # -- internals ----------------------------------------------------------------------
    def _new_bucket(self, dtype: torch.dtype, device: torch.device, s: int) -> _Bucket:
        if s > self.row_capacity:  # a bucket of its own, sized to it
            buf = self._alloc(s, dtype, device) if self.contiguous else None
            return _Bucket(dtype, s, buf, pooled=False)
        buf = None
        if self.contiguous:
            buf = self._pooled_buffer(dtype, device)
        return _Bucket(dtype, self.row_capacity, buf, pooled=self.contiguous)

    def _pooled_buffer(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for i, b in enumerate(self._buffers):
            if b.dtype == dtype and b.device == device:
                return self._buffers.pop(i)
        if self._allocated >= self._pool_size and self._in_flight:
            self._complete(self._in_flight.popleft())  # gives its buffer back
            return self._pooled_buffer(dtype, device)
        self._allocated += 1
        buf = self._alloc(self.row_capacity, dtype, device)
        self._pooled_bytes += buf.nbytes
        return buf

    def _alloc(self, row: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(self.world_size, row, dtype=dtype, device=device)

    def _issue(self, bucket: _Bucket) -> None:
        if self._open is bucket:
            self._open = None
        used = bucket.row_numel
        if bucket.buffer is None:  # gradients kept: lay them out now
            kept = bucket.entries[0].grad
            assert kept is not None
            rows = self._alloc(used, bucket.dtype, kept.device)
            for e in bucket.entries:
                _scatter_rows(rows, e, e.grad)
                e.grad = None
        elif used < bucket.capacity:
            rows = bucket.buffer[:, :used].contiguous()
        else:
            rows = bucket.buffer
        bucket.out = torch.empty(used, dtype=rows.dtype, device=rows.device)
        bucket.work = self.comm.reduce_scatter_into(
            bucket.out, rows.view(-1), async_op=self.overlap
        )
        self.buckets_issued += 1
        self._in_flight.append(bucket)
        if not self.overlap:
            self._in_flight.remove(bucket)
            self._complete(bucket)

    def _complete(self, bucket: _Bucket) -> None:
        assert bucket.work is not None and bucket.out is not None
        bucket.work.wait()
        if bucket.pooled and bucket.buffer is not None:
            self._buffers.append(bucket.buffer)
        bucket.buffer = None
        out = bucket.out
        device = all(e.slot in self.on_device for e in bucket.entries)
        if out.device.type != "cpu" and not device:
            out = self.accel.to_host(out, out=torch.empty(out.shape, dtype=out.dtype))
        mean = out.float() if out.dtype != torch.float32 else out
        mean.div_(self.world_size)
        for e in bucket.entries:
            self.accumulate(e.slot, mean[e.offset : e.offset + e.shard])
        bucket.out = bucket.work = None


def bucket_row_numel(bucket_numel: int, world_size: int, total_shard_numel: int) -> int:
    """Elements per row of a pooled bucket buffer: reduce_bucket_size / W, rounded up, but
    never longer than every trainable shard together (`total_shard_numel`)."""
    return max(1, min(-(-bucket_numel // world_size), total_shard_numel))


def pooled_bucket_nbytes(
    shard_numels: Sequence[int],
    world_size: int,
    bucket_numel: int,
    total_shard_numel: int,
    *,
    overlap: bool,
    contiguous: bool,
    itemsize: int,
) -> int:
    """Bytes of the pooled [W, row] bucket buffers `GradReducer` allocates (its
    `grad_bucket_bytes`), for trainable shards of `shard_numels` elements in the buckets'
    dtype of `itemsize` bytes: none without `contiguous` (the rows are laid out when a
    bucket is issued); one buffer when the shards that fit a row all fit in one, else the
    pool (two with `overlap`: one filling while the other's reduction runs). A shard
    longer than a row is a bucket of its own, allocated for it, not pooled; where such a
    bucket splits pooled ones that would fit in one, the hook order decides and the pool
    is counted (an upper bound)."""
    if world_size < 2 or not contiguous:
        return 0
    row = bucket_row_numel(bucket_numel, world_size, total_shard_numel)
    pooled = [s for s in shard_numels if s <= row]
    if not pooled:
        return 0
    split = sum(pooled) > row or len(pooled) < len(shard_numels)
    buffers = 2 if overlap and split else 1
    return buffers * world_size * row * itemsize


def _scatter_rows(rows: torch.Tensor, entry: _BucketSlot, grad: torch.Tensor) -> None:
    """Row q of `rows` at the entry's offset := elements [q*S, (q+1)*S) of `grad` (cast to
    the rows' dtype by the copy), zero past N."""
    s, n, at = entry.shard, entry.numel, entry.offset
    flat = grad.reshape(-1)
    for q in range(rows.shape[0]):
        lo, hi = min(q * s, n), min((q + 1) * s, n)
        row = rows[q, at : at + s]
        if hi > lo:
            row[: hi - lo].copy_(flat[lo:hi])
        if hi - lo < s:
            row[hi - lo :].zero_()
