"""NvmeParamTier: homes round-trip exactly, reads wait for their writes, errors."""

from __future__ import annotations

import pytest
import torch
from _fake_aio import FakeAio

from infinity.io.aio import AioHandle
from infinity.io.aio_checks import available_backends
from infinity.swap.param_tier import NvmeParamError, NvmeParamTier
from infinity.swap.pool import PinnedBufferPool

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8]
NUMELS = [0, 1, 3, 2047, 2048, 4097, 10_001]


def _tensor(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(0, 100, (numel,), generator=g).to(dtype)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_roundtrip_all_dtypes_and_odd_sizes(swap, lazy):
    params = {f"layers.{d}.{n}": (n, dt) for d, dt in enumerate(DTYPES) for n in NUMELS}
    pool = PinnedBufferPool(2, 8 * max(NUMELS))
    ps = NvmeParamTier(store=swap, aio=FakeAio(lazy=lazy), pool=pool)
    ps.reserve(params)
    data = {k: _tensor(n, dt, i) for i, (k, (n, dt)) in enumerate(params.items())}
    futures = [ps.swap_out(k, t) for k, t in data.items()]
    for f in futures:
        assert f.wait() is data[f.key]
    for k, t in data.items():
        into = torch.empty_like(t)
        got = ps.swap_in(k, into).wait()
        assert got is into and torch.equal(got, t)
        f = ps.swap_in(k)  # into a pool buffer
        got = f.wait()
        assert got.dtype == t.dtype and torch.equal(got, t)
        assert got.data_ptr() % 4096 == 0
        ps.release(f)
    assert pool.free_count == 2
    total = sum(t.numel() * t.element_size() for t in data.values())
    assert ps.stats.bytes_written == total and ps.stats.bytes_read == 2 * total
    m = ps.memory_stats()
    assert m["nvme_param_bytes_read"] == 2 * total and m["swap_pool_bytes"] == pool.total_bytes
    assert 0 < m["swap_pool_peak_bytes_in_use"] <= pool.buffer_bytes
    ps.close()


@pytest.mark.parametrize("backend", available_backends())
def test_roundtrip_real_io(swap, backend):
    params = {f"p{n}.{dt}": (n, dt) for dt in DTYPES[:3] for n in NUMELS}
    pool = PinnedBufferPool(1, 4 * max(NUMELS))
    with AioHandle(block_size=8192, queue_depth=4, backend=backend) as aio:
        ps = NvmeParamTier(store=swap, aio=aio, pool=pool)
        ps.reserve(params)
        data = {k: _tensor(n, dt, i) for i, (k, (n, dt)) in enumerate(params.items())}
        for k, t in data.items():
            ps.swap_out(k, t)
        ps.flush()
        for k, t in data.items():
            assert torch.equal(ps.swap_in(k, torch.empty_like(t)).wait(), t)
            f = ps.swap_in(k)
            assert torch.equal(f.wait(), t)
            ps.release(f)
        ps.close()


def test_read_never_overtakes_pending_write(swap):
    aio = FakeAio(lazy=True)  # nothing happens until waited
    ps = NvmeParamTier(store=swap, aio=aio)
    ps.reserve({"w": (100, torch.float16)})
    ps.swap_out("w", torch.ones(100, dtype=torch.float16)).wait()
    newer = torch.full((100,), 2.0, dtype=torch.float16)
    ps.swap_out("w", newer)  # not waited
    assert torch.equal(ps.swap_in("w", torch.empty(100, dtype=torch.float16)).wait(), newer)


def test_write_never_overtakes_pending_read(swap):
    aio = FakeAio(lazy=True)
    ps = NvmeParamTier(store=swap, aio=aio)
    ps.reserve({"w": (100, torch.float16)})
    ps.swap_out("w", torch.ones(100, dtype=torch.float16)).wait()
    reading = ps.swap_in("w", torch.empty(100, dtype=torch.float16))  # not waited
    ps.swap_out("w", torch.full((100,), 3.0, dtype=torch.float16))
    assert reading.done()
    assert torch.all(reading.wait() == 1.0)  # the old value, not the newer write
    assert torch.all(ps.swap_in("w", torch.empty(100, dtype=torch.float16)).wait() == 3.0)
    assert not ps._reading


def test_bad_requests(swap):
    ps = NvmeParamTier(store=swap, aio=FakeAio())
    ps.reserve({"w": (10, torch.bfloat16)})
    with pytest.raises(ValueError, match="never swapped out"):
        ps.swap_in("w", torch.empty(10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="holds 10 torch.bfloat16"):
        ps.swap_out("w", torch.zeros(10, dtype=torch.float16))
    with pytest.raises(ValueError, match="holds 10"):
        ps.swap_out("w", torch.zeros(11, dtype=torch.bfloat16))
    with pytest.raises(KeyError, match="no NVMe home"):
        ps.swap_out("v", torch.zeros(10, dtype=torch.bfloat16))
    ps.swap_out("w", torch.zeros(10, dtype=torch.bfloat16)).wait()
    with pytest.raises(ValueError, match="needs a buffer pool"):
        ps.swap_in("w")
    with pytest.raises(ValueError, match="contiguous"):
        ps.swap_in("w", torch.empty(20, dtype=torch.bfloat16)[::2])


def test_failed_write_is_never_read_as_valid(swap):
    pool = PinnedBufferPool(1, 4096)
    ps = NvmeParamTier(store=swap, aio=FakeAio(lazy=True, fail_write=1), pool=pool)
    ps.reserve({"w": (100, torch.float32)})
    ps.swap_out("w", torch.ones(100)).wait()
    ps.swap_out("w", torch.zeros(100))
    with pytest.raises(NvmeParamError, match="No space left on device"):
        ps.swap_in("w")
    assert pool.free_count == 1
    with pytest.raises(NvmeParamError, match="'w'"):
        ps.close()
    ps.close()
