"""ShardGather: when a sharded parameter's all-gather is issued, and what it lands."""

from __future__ import annotations

import torch

from infinity.accelerator import CpuAccelerator
from infinity.comm import SingleProcess
from infinity.zero.gather import ShardGather
from infinity.zero.home import HostHome


class _Handle:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> None:
        self.waited = True

    def is_completed(self) -> bool:
        return self.waited


class TwoRanks(SingleProcess):
    """Rank 0 of 2 whose peer's shard is ours + 100; records each all-gather."""

    def __init__(self) -> None:
        super().__init__()
        self.world_size = 2
        self.issued: list[tuple[int, bool]] = []
        self.handles: list[_Handle] = []

    def _all_gather(self, out, shard, async_op):
        self.issued.append((shard.numel(), async_op))
        out[: shard.numel()].copy_(shard)
        out[shard.numel() :].copy_(shard + 100)
        self.handles.append(_Handle())
        return self.handles[-1]


class _SlowRead:
    """A fetch of an NVMe shard: the read lands only when asked."""

    reading = True

    def __init__(self, shard: torch.Tensor) -> None:
        self.shard, self.landed, self.cancelled = shard, False, False

    def done(self) -> bool:
        return False

    def land(self, accel):
        self.landed = True
        event = accel.new_event()
        return self.shard.clone(), event

    def cancel(self) -> None:
        self.cancelled = True


def test_host_shard_is_gathered_as_soon_as_it_is_fetched():
    accel, comm = CpuAccelerator(), TwoRanks()
    home = HostHome(torch.arange(3.0))
    stream = accel.new_stream()
    g = ShardGather(home.fetch(accel, stream), comm, accel, stream)
    assert comm.issued == [(3, True)]  # before anyone lands it: see [Note: early all-gathers]
    assert not g.reading and not g.done()
    full, _ = g.land(accel)
    assert comm.handles[0].waited
    assert full.tolist() == [0.0, 1.0, 2.0, 100.0, 101.0, 102.0]
    assert comm.issued == [(3, True)]


def test_nvme_shard_is_gathered_when_landed():
    accel, comm = CpuAccelerator(), TwoRanks()
    read = _SlowRead(torch.ones(2))
    g = ShardGather(read, comm, accel, accel.new_stream())
    assert g.reading and comm.issued == []  # the disk decides when the read is done
    full, _ = g.land(accel)
    assert read.landed and comm.issued == [(2, False)]
    assert full.tolist() == [1.0, 1.0, 101.0, 101.0]


def test_cancel_gives_the_read_back_or_completes_the_collective():
    accel, comm = CpuAccelerator(), TwoRanks()
    read = _SlowRead(torch.ones(2))
    ShardGather(read, comm, accel, accel.new_stream()).cancel()
    assert read.cancelled and comm.issued == []
    stream = accel.new_stream()
    g = ShardGather(HostHome(torch.ones(2)).fetch(accel, stream), comm, accel, stream)
    g.cancel()  # the peer issued it too: it must complete, not be abandoned
    assert comm.handles[0].waited


def test_an_nvme_read_finished_early_is_gathered_only_when_landed():
    accel, comm = CpuAccelerator(), TwoRanks()
    read = _SlowRead(torch.ones(2))
    g = ShardGather(read, comm, accel, accel.new_stream())
    g.finish_read(accel)  # whenever the disk is done: local only, the pool buffer goes back
    assert read.landed and not g.reading and comm.issued == []
    full, _ = g.land(accel)  # the point every rank reaches: the collective
    assert comm.issued == [(2, False)] and full.tolist() == [1.0, 1.0, 101.0, 101.0]
