"""AioHandle on every backend that runs here: exact round trips at random sizes and offsets,
many requests in flight, neighbouring bytes untouched, futures that keep buffers alive."""

from __future__ import annotations

import gc
import os
import random
import weakref

import numpy as np
import pytest
import torch

from infinity.accelerator import get_accelerator
from infinity.config.sections import AioConfig
from infinity.io import AioHandle, aligned_empty, available_backends
from infinity.io.aio import plan, zeroed

ALL = ["io_uring", "aio", "posix"]


@pytest.fixture(params=ALL)
def backend(request):
    if request.param not in available_backends():
        pytest.skip(f"backend {request.param} does not run here (extension or kernel)")
    return request.param


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def test_auto_picks_first_available():
    with AioHandle(backend="auto") as h:
        assert h.backend == available_backends()[0]


def test_randomized_round_trips(backend, tmp_path):
    rng = random.Random(1234)
    sizes = [0, 1, 511, 4095, 4096, 4097, 65536 + 7, (1 << 20) + 3, 64 << 20]
    sizes += [rng.randrange(1, 8 << 20) for _ in range(6)]
    path = tmp_path / "f.bin"
    # Small blocks and two workers: requests span many ops and both slices.
    with AioHandle(block_size=64 << 10, queue_depth=8, threads=2, backend=backend) as h:
        for i, n in enumerate(sizes):
            offset = rng.choice([0, 4096, rng.randrange(0, 1 << 20), 3])
            # Aligned buffers at a random shift: sometimes matching the offset, sometimes not.
            shift = rng.choice([offset % 4096, rng.randrange(0, 4096)])
            data = _random_bytes(n, i)
            src = aligned_empty(n + shift)[shift:]
            src.copy_(data)
            h.write(src, path, offset)
            dst = aligned_empty(n + 4096)[offset % 4096 :][:n]
            h.read(dst, path, offset)
            assert torch.equal(dst, data), (n, offset, shift)


def test_many_requests_in_flight(backend, tmp_path):
    rng = random.Random(7)
    path = tmp_path / "f.bin"
    pieces, offset = [], 1
    for i in range(64):
        n = rng.randrange(0, 300_000)
        pieces.append((offset, _random_bytes(n, 100 + i)))
        offset += n + rng.randrange(0, 9000)
    with AioHandle(block_size=16 << 10, queue_depth=4, threads=2, backend=backend) as h:
        bufs = []
        for _, data in pieces:
            buf = aligned_empty(len(data))
            buf.copy_(data)
            bufs.append(buf)
        futures = [h.pwrite(b, path, off) for b, (off, _) in zip(bufs, pieces, strict=True)]
        for f in futures:
            f.wait()
            assert f.done()
        outs = [aligned_empty(len(d)) for _, d in pieces]
        futures = [h.pread(o, path, off) for o, (off, _) in zip(outs, pieces, strict=True)]
        for f in reversed(futures):
            f.wait()
        for o, (_, d) in zip(outs, pieces, strict=True):
            assert torch.equal(o, d)


def test_unaligned_writes_leave_neighbours(backend, tmp_path):
    path = tmp_path / "f.bin"
    base = _random_bytes(5 * 4096, 1)
    with AioHandle(backend=backend) as h:
        h.write(base.clone(), path)
        expected = base.clone()
        for off, n in [(1, 10), (4095, 2), (4100, 9000), (3 * 4096 - 1, 4097)]:
            patch = _random_bytes(n, off)
            h.write(patch.clone(), path, off)
            expected[off : off + n] = patch
        assert path.stat().st_size == base.numel()
        out = aligned_empty(base.numel())
        h.read(out, path)
        assert torch.equal(out, expected)


def test_concurrent_writes_sharing_a_block(backend, tmp_path):
    """Disjoint requests in flight at once that share 4 KiB blocks all land."""
    path = tmp_path / "f.bin"
    total = 64 * 1000
    expected = _random_bytes(total, 5)
    with AioHandle(backend=backend, threads=2) as h:
        h.write(torch.zeros(total, dtype=torch.uint8), path)
        bufs = [expected[i : i + 1000].clone() for i in range(0, total, 1000)]
        futures = [h.pwrite(b, path, i * 1000) for i, b in enumerate(bufs)]
        for f in futures:
            f.wait()
        out = torch.empty(total, dtype=torch.uint8)
        h.read(out, path)
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 1000, dtype=torch.bfloat16),
        lambda: torch.arange(12345, dtype=torch.int64),
        lambda: np.random.default_rng(0).standard_normal((17, 33)),
        lambda: np.arange(1001, dtype=np.float16),
    ],
)
def test_any_dtype_torch_and_numpy(backend, tmp_path, make):
    src = make()
    out = torch.empty_like(src) if isinstance(src, torch.Tensor) else np.empty_like(src)
    with AioHandle(backend=backend) as h:
        h.write(src, tmp_path / "f.bin", 12)
        h.read(out, tmp_path / "f.bin", 12)
    if isinstance(src, torch.Tensor):
        assert torch.equal(out, src)
    else:
        assert np.array_equal(out, src)


def test_future_keeps_buffer_alive(backend, tmp_path):
    data = _random_bytes(8 << 20, 3)
    with AioHandle(backend=backend, block_size=64 << 10, queue_depth=2) as h:
        buf = aligned_empty(data.numel())
        buf.copy_(data)
        alive = weakref.ref(buf.untyped_storage())
        future = h.pwrite(buf, tmp_path / "f.bin")
        del buf
        gc.collect()
        assert alive() is not None
        future.wait()
        gc.collect()
        assert alive() is None  # released once waited
        out = torch.empty_like(data)
        h.read(out, tmp_path / "f.bin")
    assert torch.equal(out, data)


def test_unwaited_requests_finish_at_close(backend, tmp_path):
    data = _random_bytes(1 << 20, 4)
    h = AioHandle(backend=backend)
    h.pwrite(data.clone(), tmp_path / "f.bin")
    h.close()
    assert (tmp_path / "f.bin").read_bytes() == data.numpy().tobytes()
    with pytest.raises(ValueError, match="closed"):
        h.pwrite(data, tmp_path / "f.bin")


def test_aligned_empty():
    for shape, dtype in [((3, 5), torch.float32), (7, torch.bfloat16), ((0,), torch.int8)]:
        t = aligned_empty(shape, dtype)
        assert t.data_ptr() % 4096 == 0
        assert t.dtype == dtype and t.is_contiguous()
        assert t.shape == ((shape,) if isinstance(shape, int) else shape)
    big = aligned_empty((3 << 20) + 5, torch.uint8)
    assert big.numel() == (3 << 20) + 5
    if not get_accelerator().pin_supported():  # unpinned: on a huge-page boundary
        assert big.data_ptr() % (2 << 20) == 0
    big.fill_(7)  # the whole span is usable
    assert int(big[-1]) == 7


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line of the mapping holding `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_zeroed_is_anonymous_memory_of_zeros_private_when_written_first():
    for written_first in (False, True):
        for numel, dtype in [
            (0, torch.float32),
            (5, torch.bfloat16),
            ((1 << 20) + 3, torch.float32),
        ]:
            t = zeroed(numel, dtype, written_first=written_first)
            assert t.numel() == numel and t.dtype == dtype and not t.any()
        t[-1] = 3.0  # writable
        # A private anonymous mapping has no path; a shared one is shmem ("/dev/zero (deleted)").
        fields = _mapping_of(t.data_ptr()).split()
        if written_first:
            assert fields[1][3] == "p" and len(fields) == 5, fields
        else:
            assert fields[1][3] == "s", fields


def test_plan_cuts_aligned_middle():
    segs = plan(address=4096 * 10 + 100, nbytes=20000, offset=100, direct=True)
    assert [(s.direct, s.offset, s.nbytes) for s in segs] == [
        (False, 100, 3996),
        (True, 4096, 12288),
        (False, 16384, 3716),
    ]
    assert sum(s.nbytes for s in segs) == 20000
    assert all(not s.direct for s in plan(4096 * 10 + 1, 20000, 100, True))
    assert plan(0, 0, 5, True) == []


def test_from_config():
    cfg = AioConfig(block_size=1 << 18, queue_depth=4, thread_count=2, backend="posix")
    with AioHandle.from_config(cfg) as h:
        assert (h.block_size, h.queue_depth, h.threads, h.backend) == (1 << 18, 4, 2, "posix")


def test_parallel_workers_match_posix(tmp_path):
    """Every native backend reads back what the POSIX twin wrote, and the reverse."""
    data = _random_bytes((3 << 20) + 123, 9)
    backends = available_backends()
    for writer in backends:
        for reader in backends:
            path = tmp_path / f"{writer}-{reader}.bin"
            with AioHandle(backend=writer, threads=3, block_size=1 << 16) as w:
                w.write(data.clone(), path, 777)
            out = torch.empty_like(data)
            with AioHandle(backend=reader, threads=2, block_size=1 << 17) as r:
                r.read(out, path, 777)
            assert torch.equal(out, data), (writer, reader)
            os.unlink(path)
