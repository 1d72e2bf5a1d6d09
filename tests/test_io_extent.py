"""ExtentIO: the transfers every NVMe tier composes. Bytes counted by one rule, one error
type naming tier, op, file, offset and bytes, and a read of an extent changed on disk
stopping the tier with that error."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from _fake_aio import FakeAio

from infinity.io import AioHandle
from infinity.io.checksum import CHUNK_BYTES
from infinity.io.extent import ExtentError, ExtentIO
from infinity.swap.grad_tier import NvmeGradError, NvmeGradTier
from infinity.swap.nvme_state import NvmeStateError, NvmeStateTier
from infinity.swap.param_tier import NvmeParamError, NvmeParamTier
from infinity.swap.pool import PinnedBufferPool


@pytest.fixture
def aio():
    with AioHandle(backend="posix") as handle:
        yield handle


def _zero(path: str, offset: int, nbytes: int) -> None:
    """What a stray process or a bad disk does to a live swap file."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(nbytes), offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("sample", [64, 4096], ids=["sampled-inline", "full-threads"])
def test_a_changed_extent_raises_naming_file_offset_and_the_fix(tmp_path, aio, sample):
    path = str(tmp_path / "x.swp")
    io = ExtentIO(aio, tier="optim", error=NvmeStateError)
    io.sums.sample_bytes = sample
    data = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    io.write(data, path, 8192, what="optimizer sub-group 3").wait()
    back = torch.empty_like(data)
    io.read(back, path, 8192, what="optimizer sub-group 3").wait()
    assert torch.equal(back, data)
    _zero(path, 8192 + 303_104, 4096)  # one page
    with pytest.raises(NvmeStateError) as e:
        io.read(back, path, 8192, what="optimizer sub-group 3").wait()
    err = e.value
    assert isinstance(err, ExtentError) and err.errno == errno.EIO
    assert (err.tier, err.op, err.path, err.offset, err.nbytes) == (
        "optim", "read", path, 8192, 1 << 20
    )  # fmt: skip
    text = str(err)
    assert "optimizer sub-group 3" in text and path in text and "read back other bytes" in text
    first = 8192 + 303_104 // CHUNK_BYTES * CHUNK_BYTES  # the chunk holding the zeros
    assert f"file bytes [{first}, {first + CHUNK_BYTES})" in text
    assert "resume from the last checkpoint" in text
    with pytest.raises(NvmeStateError, match="earlier transfer failed"):
        io.check_usable("sweep")
    io.close()


def test_without_checksums_a_change_goes_unseen(tmp_path, aio):
    path = str(tmp_path / "x.swp")
    io = ExtentIO(aio, tier="grad", checksums=False)
    io.write(torch.ones(4096), path, 0, what="gradients").wait()
    _zero(path, 0, 4096)
    back = torch.empty(4096)
    io.read(back, path, 0, what="gradients").wait()
    assert back[0] == 0 and io.failed is None


def test_bytes_writes_at_issue_reads_when_landed_failures_and_drops_never(tmp_path):
    path = str(tmp_path / "x.swp")
    open(path, "wb").close()
    fake = FakeAio(lazy=True, fail_write=1)
    io = ExtentIO(fake, tier="grad", error=NvmeGradError)
    first = io.write(torch.ones(1000), path, 0, what="gradients of sub-group 0")
    assert io.stats.bytes_written == 4000  # counted when issued
    failing = io.write(torch.ones(10), path, 8192, what="gradients of sub-group 1")
    first.wait()
    with pytest.raises(NvmeGradError, match=r"write of gradients of sub-group 1 \(40 bytes"):
        failing.wait()
    assert io.stats.bytes_written == 4000  # the failed write is taken back
    read = io.read(torch.empty(1000), path, 0, what="gradients of sub-group 0", count=7)
    assert io.stats.bytes_read == 0
    read.wait()
    read.wait()
    assert io.stats.bytes_read == 7  # once, the payload the tier asked to count
    io.read(torch.empty(1000), path, 0, what="gradients of sub-group 0").drop()
    assert io.stats.bytes_read == 7 and io.stats.wait_s >= 0


def test_optimizer_state_changed_on_disk_stops_the_sweep(swap, aio):
    numels = [70_000] * 6  # 840 KB per sub-group: several chunks each
    store = NvmeStateTier(numels, store=swap, aio=aio, buffer_count=3)
    for i in range(len(numels)):
        store.initialize(i, torch.full((numels[i],), float(i)))
    for _, s in store.sweep():
        s.master.add_(1.0)
    ext = store._extents[4]  # past the reads started for the next sweep
    _zero(ext.path, ext.offset + 65536, 1 << 20)
    with pytest.raises(NvmeStateError) as e:
        for _, s in store.sweep():
            s.master.add_(1.0)
    text = str(e.value)
    assert "read of optimizer sub-group 4" in text and ext.path in text
    assert f"at offset {ext.offset} of" in text and "read back other bytes" in text
    with pytest.raises(NvmeStateError, match="earlier transfer failed"):
        store.read(0)
    store.close()


def test_spilled_gradients_changed_on_disk_are_found(swap, aio):
    numels = [20_000, 20_000, 20_000]
    store = NvmeGradTier(numels, store=swap, aio=aio, buffer_count=2)
    for g in (2, 1, 0):  # backward: each pushes the one before it to disk
        store.add(g, 0, torch.ones(numels[g]))
    assert store.residency[2].name == "ON_NVME"
    store.add(2, 4, torch.ones(10))  # a small add on disk keeps its rows checked
    ext = store._extents[2]
    _zero(ext.path, ext.offset, 4096)
    with pytest.raises(NvmeGradError, match=r"gradients of sub-group 2 .*read back other"):
        for g in range(3):
            store.take(g)
            store.release(g)
    store.close()


def test_parameters_changed_on_disk_are_found(swap, aio):
    pool = PinnedBufferPool(2, 1 << 16, pin=False)
    ps = NvmeParamTier(store=swap, aio=aio, pool=pool)
    ps.reserve({"w": (10_000, torch.float16)})
    ps.swap_out("w", torch.ones(10_000, dtype=torch.float16)).wait()
    fut = ps.swap_in("w")
    assert torch.all(fut.wait() == 1)
    ps.release(fut)
    ext = ps.layout("w").extent
    _zero(ext.path, ext.offset + 4096, 4096)  # one page
    with pytest.raises(NvmeParamError, match=r"swap_in of parameter 'w' .*param\.0\.swp"):
        ps.swap_in("w").wait()
    assert pool.free_count == 2  # the failed read gave its buffer back
    ps.close()


def _flip(path: str, at: int) -> None:
    """One bit of one byte changed in a live swap file."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte[0] ^ 0x04]), at)
    finally:
        os.close(fd)


WHERE = {"first": lambda n: 0, "mid-page": lambda n: 4096 + 2001, "last": lambda n: n - 1}


@pytest.mark.parametrize("where", WHERE)
def test_one_byte_changed_in_an_optimizer_extent_is_found(swap, aio, where):
    numels = [70_001] * 6  # 840,012 bytes per sub-group: not a whole number of pages
    store = NvmeStateTier(numels, store=swap, aio=aio, buffer_count=3)
    for i in range(len(numels)):
        store.initialize(i, torch.full((numels[i],), float(i)))
    for _, s in store.sweep():
        s.master.add_(1.0)
    ext = store._extents[4]  # past the reads started for the next sweep
    assert ext.nbytes == 12 * 70_001
    _flip(ext.path, ext.offset + WHERE[where](ext.nbytes))
    with pytest.raises(NvmeStateError, match="read of optimizer sub-group 4 .*read back other"):
        for _, s in store.sweep():
            s.master.add_(1.0)
    store.close()


@pytest.mark.parametrize("where", WHERE)
def test_one_byte_changed_in_a_parameter_extent_is_found(swap, aio, where):
    pool = PinnedBufferPool(2, 1 << 16, pin=False)
    ps = NvmeParamTier(store=swap, aio=aio, pool=pool)
    ps.reserve({"w": (10_001, torch.float16)})  # 20,002 bytes
    ps.swap_out("w", torch.ones(10_001, dtype=torch.float16)).wait()
    ext = ps.layout("w").extent
    _flip(ext.path, ext.offset + WHERE[where](20_002))
    with pytest.raises(NvmeParamError, match=r"swap_in of parameter 'w' .*read back other"):
        ps.swap_in("w").wait()
    ps.close()
