"""OffloadParam with an NVMe home: fetch reads into a pool buffer, wait copies it to the
device and gives the buffer back, release, refresh, the home's reads and writes, and read
failures."""

from __future__ import annotations

import os

import pytest
import torch
from _fake_aio import FakeAio
from torch import nn

from infinity.accelerator import CpuAccelerator
from infinity.io.aio import AioHandle
from infinity.io.aio_checks import available_backends
from infinity.swap.param_tier import NvmeParamError, NvmeParamTier
from infinity.swap.pool import PinnedBufferPool
from infinity.zero import HomeTier, NvmeHome, OffloadParam, ParamState

SHAPE = (3, 700)  # 2100 elements: not a whole number of pages
NUMEL = 2100


def _store(swap, aio, buffers=2):
    pool = PinnedBufferPool(buffers, 3 * 4096)
    ps = NvmeParamTier(store=swap, aio=aio, pool=pool)
    ps.reserve({"frozen": (NUMEL, torch.float16)})
    ps.reserve_flat({"a": (0, NUMEL), "b": (4096, NUMEL)}, 8192, torch.float16)
    return ps, pool


def _nvme_record(ps, name, accel, seed=0, *, write=True):
    """A record whose home is `name` in `ps`, written with its weights unless the caller
    writes the flat space (as the optimizer does)."""
    g = torch.Generator().manual_seed(seed)
    param = nn.Parameter(torch.randn(SHAPE, generator=g).half())
    weights = param.detach().reshape(-1).clone()
    home = NvmeHome(ps, name)
    if write:
        home.write(weights)
    rec = OffloadParam(name, param, home, device=accel.device)
    rec.offload()
    return rec, weights


def _gathered(rec):
    return rec.param.detach().cpu().reshape(-1)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_fetch_wait_release_from_nvme(swap, accel, lazy):
    ps, pool = _store(swap, FakeAio(lazy=lazy))
    rec, weights = _nvme_record(ps, "frozen", accel)
    assert rec.home.tier is HomeTier.NVME and rec.home.host_bytes == 0 and rec.itemsize == 2
    assert rec.fetch(accel, accel.new_stream())
    assert rec.state is ParamState.INFLIGHT and rec.reading and rec.device_tensor is None
    assert pool.free_count == 1
    rec.wait(accel)
    assert rec.state is ParamState.LIVE and not rec.reading and pool.free_count == 2
    assert rec.param.shape == SHAPE and rec.param.device.type == accel.device.type
    assert torch.equal(_gathered(rec), weights)
    rec.release()
    assert rec.state is ParamState.RELEASED and rec.param.numel() == 0
    with pytest.raises(RuntimeError, match="RELEASED"):
        rec.wait(accel)


def test_fetch_without_a_free_buffer(swap):
    accel = CpuAccelerator()
    ps, pool = _store(swap, FakeAio(lazy=True), buffers=1)
    a, _ = _nvme_record(ps, "frozen", accel)
    b, _ = _nvme_record(ps, "a", accel, write=False)
    ps.write_flat(0, torch.ones(8192).half())
    assert b.dtype == torch.float16 and b.numel == NUMEL and b.home.numel == NUMEL
    assert a.fetch(accel, accel.current_stream(), block=False)
    assert not b.fetch(accel, accel.current_stream(), block=False)
    assert b.state is ParamState.RELEASED and not b.reading
    a.release()  # an in-flight read lands and gives its buffer back
    assert a.state is ParamState.RELEASED and pool.free_count == 1 and not ps._reading
    assert b.fetch(accel, accel.current_stream(), block=False)
    b.wait(accel)
    assert torch.all(b.param == 1.0)


def test_refresh_and_home_reads_and_writes(swap, accel):
    ps, pool = _store(swap, FakeAio(lazy=True))
    rec, weights = _nvme_record(ps, "a", accel, write=False)
    flat = torch.zeros(8192).half()
    flat[:NUMEL] = weights
    ps.write_flat(0, flat)  # the optimizer writes the flat space
    assert torch.equal(rec.home.read(), weights)
    rec.fetch(accel, accel.new_stream())
    rec.wait(accel)
    assert torch.equal(_gathered(rec), weights)
    flat[:NUMEL] = 5.0  # an optimizer step
    ps.write_flat(0, flat[:4096])
    rec.refresh(accel)
    assert torch.all(rec.param == 5.0) and pool.free_count == 2
    rec.home.write(torch.full(SHAPE, 7.0))  # fp32 in: stored in the model dtype
    assert torch.all(rec.home.read() == 7.0) and torch.all(rec.param == 5.0)
    rec.refresh(accel)
    assert torch.all(rec.param == 7.0)
    rec.refresh(accel, torch.full((3,), 2.0).half(), 2097)  # new values at hand: no read
    read = ps.stats.bytes_read
    assert torch.all(rec.param.reshape(-1)[2097:] == 2.0) and torch.all(rec.param[0] == 7.0)
    assert ps.stats.bytes_read == read and pool.free_count == 2
    with pytest.raises(ValueError, match="2100"):
        rec.home.write(torch.zeros(5))


@pytest.mark.parametrize("backend", available_backends())
def test_nvme_fetch_real_io(swap, backend):
    accel = CpuAccelerator()
    with AioHandle(block_size=8192, queue_depth=4, backend=backend) as aio:
        ps, pool = _store(swap, aio, buffers=1)
        names = ["frozen", "a", "b"]
        recs = [_nvme_record(ps, name, accel, seed=i) for i, name in enumerate(names)]
        for _ in range(2):
            for rec, weights in recs:
                assert rec.fetch(accel, accel.current_stream(), block=False)
                rec.wait(accel)
                assert torch.equal(_gathered(rec), weights) and pool.free_count == 1
                assert torch.equal(rec.home.read(), weights)
                rec.release()
        ps.close()


def test_failed_read_leaves_the_record_released(swap, accel):
    ps, pool = _store(swap, FakeAio(lazy=True, fail_read=0))
    rec, weights = _nvme_record(ps, "frozen", accel)
    rec.fetch(accel, accel.new_stream())
    with pytest.raises(NvmeParamError, match=r"parameter 'frozen' .*param\.0\.swp"):
        rec.wait(accel)
    assert rec.state is ParamState.RELEASED and rec.param.numel() == 0
    assert pool.free_count == 2 and rec.device_tensor is None and not rec.reading
    rec.fetch(accel, accel.new_stream())  # the next read succeeds
    rec.wait(accel)
    assert torch.equal(_gathered(rec), weights)


def test_a_home_is_a_reserved_layout(swap):
    accel = CpuAccelerator()
    ps, _ = _store(swap, FakeAio())
    param = nn.Parameter(torch.zeros(10).half())
    with pytest.raises(ValueError, match="holds 2100 elements, the parameter has 10"):
        OffloadParam("a", param, NvmeHome(ps, "a"), device=accel.device)
    with pytest.raises(KeyError, match="no NVMe home"):
        NvmeHome(ps, "nobody")


def test_read_refused_at_submit_real_io(swap):
    """A swap file cut short: the read fails when issued, naming the parameter and file."""
    accel = CpuAccelerator()
    with AioHandle(block_size=8192, queue_depth=2) as aio:
        ps, pool = _store(swap, aio)
        rec, _ = _nvme_record(ps, "b", accel, write=False)
        ps.write_flat(0, torch.ones(8192).half()).wait()
        os.truncate(ps.flat.extent.path, ps.flat.extent.offset + 4096)
        with pytest.raises(NvmeParamError, match=r"parameter 'b' .*param\.\d\.swp"):
            rec.fetch(accel, accel.current_stream())
        assert rec.state is ParamState.RELEASED and pool.free_count == 2 and not rec.reading
