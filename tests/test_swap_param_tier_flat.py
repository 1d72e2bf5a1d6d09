"""NvmeParamTier's flat extent: parameters inside the optimizer's flat space round-trip,
whole-page reads, transfers ordered by the ranges they touch, non-blocking swap_in."""

from __future__ import annotations

import pytest
import torch
from _fake_aio import FakeAio

from infinity.io.aio import AioHandle
from infinity.io.aio_checks import available_backends
from infinity.swap.param_tier import NvmeParamError, NvmeParamTier
from infinity.swap.pool import PinnedBufferPool
from infinity.swap.store import align_up

ALIGN = 2048  # elements: the optimizer's SLOT_ALIGN
NUMELS = [1, 3, 2047, 0, 2048, 2049, 5000, 7]


def _layout(numels, align=ALIGN):
    """name -> (offset, numel) packed at `align` elements, and the aligned total."""
    entries, at = {}, 0
    for i, n in enumerate(numels):
        entries[f"layers.{i}.w"] = (at, n)
        at += align_up(n, align)
    return entries, max(at, align)


def _flat(entries, total, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    flat = torch.zeros(total, dtype=dtype)
    for off, n in entries.values():
        flat[off : off + n] = torch.randn(n, generator=g).to(dtype)
    return flat


def _write_sub_groups(ps, flat, size):
    return [ps.write_flat(s, flat[s : s + size]) for s in range(0, flat.numel(), size)]


def _check_reads(ps, entries, flat, pool):
    for name, (off, n) in entries.items():
        want = flat[off : off + n]
        f = ps.swap_in(name)
        got = f.wait()
        assert got.dtype == flat.dtype and torch.equal(got, want), name
        ps.release(f)
        into = torch.empty(n, dtype=flat.dtype)
        assert torch.equal(ps.swap_in(name, into).wait(), want)
    assert pool.free_count == pool.buffer_count


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_flat_roundtrip_whole_page_reads(swap, dtype, lazy):
    entries, total = _layout(NUMELS)
    itemsize = dtype.itemsize
    pool = PinnedBufferPool(2, align_up(max(NUMELS) * itemsize))
    aio = FakeAio(lazy=lazy)
    ps = NvmeParamTier(store=swap, aio=aio, pool=pool)
    ps.reserve_flat(entries, total, dtype)
    flat = _flat(entries, total, dtype, seed=1)
    # Sub-groups of 3 x 2048 elements split parameters; lazy writes are still pending here.
    _write_sub_groups(ps, flat, 3 * ALIGN)
    aio.requests.clear()
    _check_reads(ps, entries, flat, pool)
    pool_reads = aio.requests[0::2]  # each name: one read into the pool, one into `into`
    for (name, (off, n)), (op, offset, nbytes, address) in zip(
        entries.items(), pool_reads, strict=True
    ):
        assert op == "read" and offset - ps.flat.extent.offset == off * itemsize, name
        assert offset % 4096 == 0 and address % 4096 == 0
        assert nbytes == align_up(n * itemsize) and nbytes % 4096 == 0  # whole pages
    ps.flush()
    assert ps.stats.bytes_written == total * itemsize
    ps.close()


@pytest.mark.parametrize("backend", available_backends())
def test_flat_roundtrip_real_io(swap, backend):
    entries, total = _layout(NUMELS)
    pool = PinnedBufferPool(1, align_up(max(NUMELS) * 2))
    with AioHandle(block_size=8192, queue_depth=4, backend=backend) as aio:
        ps = NvmeParamTier(store=swap, aio=aio, pool=pool)
        ps.reserve({"frozen": (4097, torch.float16)})  # an own extent next to the flat one
        ps.reserve_flat(entries, total, torch.float16)
        frozen = torch.randn(4097).half()
        ps.swap_out("frozen", frozen)
        flat = _flat(entries, total, torch.float16, seed=2)
        _write_sub_groups(ps, flat, 2 * ALIGN)
        _check_reads(ps, entries, flat, pool)
        assert torch.equal(ps.swap_in("frozen", torch.empty(4097).half()).wait(), frozen)
        # A flat name is rewritten alone with swap_out, leaving its neighbours alone.
        name, (off, n) = "layers.5.w", entries["layers.5.w"]
        flat[off : off + n] = -1.0
        ps.swap_out(name, flat[off : off + n].clone()).wait()
        _check_reads(ps, entries, flat, pool)
        ps.close()


def test_flat_write_waits_for_reads_in_its_range_only(swap):
    entries, total = _layout([100, 3000, 50])  # offsets 0, 2048, 6144; total 8192
    pool = PinnedBufferPool(3, 8192)
    aio = FakeAio(lazy=True)
    # Without checksums: a read's check waits for it on a thread, which runs a lazy read.
    ps = NvmeParamTier(store=swap, aio=aio, pool=pool, checksums=False)
    ps.reserve_flat(entries, total, torch.float16)
    old = _flat(entries, total, torch.float16, seed=3)
    for f in _write_sub_groups(ps, old, 4096):
        f.wait()
    first = ps.swap_in("layers.0.w")  # elements [0, 100): in the first sub-group
    last = ps.swap_in("layers.2.w")  # elements [6144, 6194): in the second
    new = _flat(entries, total, torch.float16, seed=4)
    pending = ps.write_flat(0, new[:4096])
    assert first.done() and not last.done()  # only the read in its range landed first
    assert torch.equal(first.wait(), old[:100])
    assert not pending.done()
    # A read over the written range waits for the write: "layers.1.w" is split by it.
    split = torch.cat([new[2048:4096], old[4096:5048]])
    assert torch.equal(ps.swap_in("layers.1.w", torch.empty(3000).half()).wait(), split)
    assert pending.done()
    pending2 = ps.write_flat(4096, new[4096:])
    assert last.done() and torch.equal(last.wait(), old[6144:6194])
    assert torch.equal(ps.swap_in("layers.0.w", torch.empty(100).half()).wait(), new[:100])
    assert not pending2.done()
    ps.flush()
    assert pending2.done() and not ps._flat_writes
    for f in (first, last):
        ps.release(f)
    assert pool.free_count == 3


def test_flat_writes_keep_their_order(swap):
    entries, total = _layout([4096])
    ps = NvmeParamTier(store=swap, aio=FakeAio(lazy=True))
    ps.reserve_flat(entries, total, torch.float32)
    ps.write_flat(0, torch.ones(4096))
    ps.write_flat(2048, torch.full((2048,), 2.0))  # overlaps the first: waits for it
    got = ps.swap_in("layers.0.w", torch.empty(4096)).wait()
    assert torch.all(got[:2048] == 1.0) and torch.all(got[2048:] == 2.0)


def test_swap_in_without_blocking(swap):
    entries, total = _layout([10, 20, 30])
    pool = PinnedBufferPool(1, 4096)
    aio = FakeAio(lazy=True)
    ps = NvmeParamTier(store=swap, aio=aio, pool=pool)
    ps.reserve_flat(entries, total, torch.float16)
    ps.write_flat(0, _flat(entries, total, torch.float16, seed=5)).wait()
    a = ps.swap_in("layers.0.w", block=False)
    assert a is not None and pool.free_count == 0
    issued = len(aio.requests)
    assert ps.swap_in("layers.1.w", block=False) is None
    assert len(aio.requests) == issued  # nothing issued
    a.wait()
    ps.release(a)
    b = ps.swap_in("layers.1.w", block=False)
    assert b is not None and b.wait().numel() == 20
    ps.release(b)
    assert pool.free_count == 1 and pool.peak_bytes_in_use <= pool.total_bytes


def test_bad_flat_requests(swap):
    ps = NvmeParamTier(store=swap, aio=FakeAio())
    with pytest.raises(ValueError, match="before reserve_flat"):
        ps.write_flat(0, torch.zeros(2048).half())
    with pytest.raises(ValueError, match="'b'.*multiple of 4096 bytes"):
        ps.reserve_flat({"a": (0, 10), "b": (1000, 10)}, 4096, torch.float16)
    with pytest.raises(ValueError, match="'b' = elements \\[2048, 6144\\)"):
        ps.reserve_flat({"a": (0, 10), "b": (2048, 4096)}, 4096, torch.float16)
    with pytest.raises(ValueError, match="'a' and 'b' overlap"):
        ps.reserve_flat({"a": (0, 4000), "b": (2048, 10)}, 8192, torch.float16)
    ps.reserve({"frozen": (10, torch.float16)})
    with pytest.raises(ValueError, match="already reserved"):
        ps.reserve_flat({"frozen": (0, 10)}, 2048, torch.float16)
    ps.reserve_flat({"a": (0, 3000), "b": (4096, 10)}, 6144, torch.float16)
    with pytest.raises(ValueError, match="already reserved"):
        ps.reserve_flat({"c": (0, 10)}, 2048, torch.float16)
    with pytest.raises(ValueError, match="holds 6144 torch.float16"):
        ps.write_flat(1024, torch.zeros(10).half())  # not on a page
    with pytest.raises(ValueError, match="holds 6144 torch.float16"):
        ps.write_flat(4096, torch.zeros(4096).half())  # past the end
    with pytest.raises(ValueError, match="holds 6144 torch.float16"):
        ps.write_flat(0, torch.zeros(10))  # fp32
    ps.write_flat(0, torch.zeros(2048).half()).wait()  # half of "a"
    with pytest.raises(ValueError, match="never swapped out"):
        ps.swap_in("a", torch.empty(3000).half())
    ps.write_flat(2048, torch.zeros(2048).half()).wait()
    assert torch.all(ps.swap_in("a", torch.empty(3000).half()).wait() == 0)
    with pytest.raises(ValueError, match="never swapped out"):
        ps.swap_in("b", torch.empty(10).half())


def test_failed_flat_write_is_never_read_as_valid(swap):
    entries, total = _layout([100, 100])
    pool = PinnedBufferPool(1, 4096)
    ps = NvmeParamTier(store=swap, aio=FakeAio(lazy=True, fail_write=1), pool=pool)
    ps.reserve_flat(entries, total, torch.float16)
    ps.write_flat(0, torch.ones(total).half()).wait()
    ps.write_flat(0, torch.zeros(2048).half())  # fails: ENOSPC
    with pytest.raises(NvmeParamError, match=r"write_flat of flat elements \[0, 2048\)"):
        ps.swap_in("layers.0.w")
    assert pool.free_count == 1
    f = ps.swap_in("layers.1.w")  # outside the failed range: fine
    assert torch.all(f.wait() == 1.0)
    ps.release(f)
    with pytest.raises(NvmeParamError, match="No space left"):
        ps.flush()


def test_failed_read_names_the_parameter_and_the_file(swap):
    entries, total = _layout([100])
    pool = PinnedBufferPool(1, 4096)
    ps = NvmeParamTier(store=swap, aio=FakeAio(lazy=True, fail_read=0), pool=pool)
    ps.reserve_flat(entries, total, torch.float16)
    ps.write_flat(0, torch.ones(total).half()).wait()
    f = ps.swap_in("layers.0.w")
    with pytest.raises(NvmeParamError, match=r"swap_in of parameter 'layers.0.w' .*param\.0\.swp"):
        f.wait()
    assert pool.free_count == 1 and not ps._reading
    f = ps.swap_in("layers.0.w")
    assert torch.all(f.wait() == 1.0)
    ps.release(f)


def test_written_ranges_merge_like_a_mask():
    from infinity.swap.param_tier import _Coverage

    g = torch.Generator().manual_seed(0)
    cov, mask = _Coverage(), torch.zeros(200, dtype=torch.bool)
    for _ in range(60):
        a, b = sorted(torch.randint(0, 201, (2,), generator=g).tolist())
        cov.add(a, b)
        mask[a:b] = True
        assert all(s < t for s, t in zip(cov.stops[:-1], cov.starts[1:], strict=True))
        for _ in range(20):
            x, y = sorted(torch.randint(0, 201, (2,), generator=g).tolist())
            assert cov.covers(x, y) == bool(mask[x:y].all()), (x, y)
