"""The pinned buffer pool: fixed size, alignment, blocking acquire, clear errors."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from infinity.config import Config, OffloadParamConfig, RunFacts, ZeroConfig, resolve_run
from infinity.io import aio as aio_mod
from infinity.swap import pool as pool_mod
from infinity.swap.pool import PinnedBufferPool, param_buffer_numels, param_pool_nbytes


def test_buffers_aligned_disjoint_and_fixed():
    pool = PinnedBufferPool(3, 5000)
    assert pool.buffer_bytes == 8192 and pool.total_bytes == 3 * 8192
    bufs = [pool.acquire(8192, f"h{i}") for i in range(3)]
    ptrs = sorted(b.data.data_ptr() for b in bufs)
    assert all(p % 4096 == 0 for p in ptrs)
    assert all(b - a >= 8192 for a, b in zip(ptrs, ptrs[1:], strict=False))
    assert all(b.data.data_ptr() >= pool.arena.data_ptr() for b in bufs)
    assert pool.try_acquire(1, "late") is None  # never grows
    for b in bufs:
        pool.release(b)
    assert pool.free_count == 3


def test_view_and_peak_bytes():
    pool = PinnedBufferPool(2, 4096)
    a = pool.acquire(100, "a")
    b = pool.acquire(3000, "b")
    v = a.view(torch.float16, 50)
    assert v.dtype == torch.float16 and v.numel() == 50
    with pytest.raises(ValueError, match="do not fit"):
        a.view(torch.float32, 2000)
    pool.release(a)
    pool.release(b)
    assert pool.bytes_in_use == 0 and pool.peak_bytes_in_use == 3100
    assert pool.memory_stats()["swap_pool_peak_bytes_in_use"] == 3100
    with pytest.raises(ValueError, match="not lent"):
        pool.release(a)


def test_oversize_request_is_an_immediate_value_error():
    pool = PinnedBufferPool(2, 4096)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="'big.weight' needs 4097 bytes"):
        pool.acquire(4097, "big.weight")
    assert time.monotonic() - t0 < 1


def test_acquire_blocks_until_another_thread_releases():
    pool = PinnedBufferPool(1, 4096)
    held = threading.Event()
    release = threading.Event()

    def other():
        buf = pool.acquire(10, "worker")
        held.set()
        release.wait(5)
        pool.release(buf)

    t = threading.Thread(target=other)
    t.start()
    held.wait(5)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(10, "main", timeout_s=5)))
    waiter.start()
    time.sleep(0.05)
    assert not got  # still waiting
    release.set()
    waiter.join(5)
    t.join(5)
    assert got and got[0].holder == "main"


def test_timeout_names_holders():
    pool = PinnedBufferPool(1, 4096)
    ready, done = threading.Event(), threading.Event()

    def other():
        buf = pool.acquire(10, "layers.0.w")
        ready.set()
        done.wait(5)
        pool.release(buf)

    t = threading.Thread(target=other)
    t.start()
    ready.wait(5)
    with pytest.raises(TimeoutError, match="layers.0.w"):
        pool.acquire(10, "layers.1.w", timeout_s=0.05)
    done.set()
    t.join(5)


def test_self_deadlock_is_an_immediate_error():
    pool = PinnedBufferPool(2, 4096)
    pool.acquire(1, "a")
    pool.acquire(1, "b")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="holds all 2"):
        pool.acquire(1, "c", timeout_s=30)
    assert time.monotonic() - t0 < 1


def test_borrow_releases_on_error():
    pool = PinnedBufferPool(1, 4096)
    with pytest.raises(KeyError), pool.borrow(10, "x"):
        raise KeyError("boom")
    assert pool.free_count == 1


def test_failed_pinning_falls_back_to_unpinned_naming_memlock(monkeypatch, caplog):
    class PinningAccel:
        def pin_supported(self):
            return True

        def empty_pinned(self, shape, dtype):
            raise RuntimeError("cudaHostAlloc: out of memory")

    monkeypatch.setattr(pool_mod, "get_accelerator", lambda: PinningAccel())
    monkeypatch.setattr(aio_mod, "get_accelerator", lambda: PinningAccel())
    monkeypatch.setattr(pool_mod.resource, "getrlimit", lambda r: (8192, 8192))
    with caplog.at_level(logging.INFO, logger="infinity.swap.pool"):
        pool = PinnedBufferPool(4, 4096)
    assert not pool.pinned and pool.arena.data_ptr() % 4096 == 0
    msgs = [r.getMessage() for r in caplog.records]
    assert any("exceed RLIMIT_MEMLOCK (0.0 MiB)" in m for m in msgs)  # checked up front
    assert any("unpinned" in m and "ulimit -l" in m for m in msgs)


def test_pins_directly_when_allowed(monkeypatch):
    calls = []

    class PinningAccel:
        def pin_supported(self):
            return True

        def empty_pinned(self, shape, dtype):
            calls.append((shape, dtype))
            return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(pool_mod, "get_accelerator", lambda: PinningAccel())
    monkeypatch.setattr(aio_mod, "get_accelerator", lambda: PinningAccel())
    monkeypatch.setattr(pool_mod.resource, "getrlimit", lambda r: (-1, -1))
    monkeypatch.setattr(pool_mod.resource, "RLIM_INFINITY", -1)
    pool = PinnedBufferPool(2, 4096)
    assert pool.pinned and len(calls) == 1  # one arena, allocated pinned (no copy)
    assert calls[0][0][0] >= 8192 and pool.arena.data_ptr() % 4096 == 0


def test_for_params_sizes_from_config_and_model():
    cfg = _auto([10_000, 4_000])
    pool = PinnedBufferPool.for_params(cfg, element_size=2, numels=[10_000, 4_000])
    assert pool.buffer_count == 3 and pool.buffer_bytes >= 20_000 and pool.large_bytes == 0
    # A set buffer_size under the largest parameter: that one goes through its own buffer.
    cfg = OffloadParamConfig(device="nvme", buffer_count=3, buffer_size=100)
    pool = PinnedBufferPool.for_params(cfg, element_size=2, numels=[10_000])
    assert (pool.buffer_count, pool.buffer_bytes, pool.large_bytes) == (4, 4096, 20_480)


def _auto(numels):
    """offload_param with buffer_size "auto" (buffer_count 3), resolved for parameters of
    `numels` elements: the pool takes a resolved section."""
    loaded = Config(zero_optimization=ZeroConfig(offload_param=OffloadParamConfig(buffer_count=3)))
    return resolve_run(loaded, RunFacts(param_numels=tuple(numels))).zero_optimization.offload_param


def test_an_outlier_parameter_gets_its_own_buffer():
    """A parameter over 4x the rest (an embedding) has one buffer of its size; the others
    are sized for the largest of the rest. A set buffer_size that holds every parameter
    keeps one class."""
    numels = [5_000_000, 40_000, 30_000, 2_000]  # the embedding, then linear layers
    auto = _auto(numels)
    assert param_buffer_numels(auto, numels) == (40_000, 5_000_000)
    few = [100, 60, 30]
    assert param_buffer_numels(_auto(few), few) == (100, 0)  # no outlier: one class
    m = 1 << 22
    three = [m, m, m, 5]
    assert param_buffer_numels(_auto(three), three) == (m, 0)  # three over 4x: one class
    tiny = [m - 1, 5]
    assert param_buffer_numels(_auto(tiny), tiny) == (m - 1, 0)  # small: buffers cost little
    assert param_pool_nbytes(auto, element_size=2, numels=numels) == 3 * 81_920 + 10_002_432
    pool = PinnedBufferPool.for_params(auto, element_size=2, numels=numels)
    assert (pool.buffer_count, pool.buffer_bytes, pool.large_bytes) == (4, 81_920, 10_002_432)
    assert pool.total_bytes == param_pool_nbytes(auto, element_size=2, numels=numels)
    big = pool.acquire(10_000_000, "embed")
    assert big.data.numel() == pool.large_bytes
    # The outlier's buffer is taken: another large request waits, small ones do not.
    assert pool.try_acquire(1_500_000, "lm_head") is None
    small = [pool.acquire(80_000, f"w{i}") for i in range(3)]
    assert all(b.data.numel() == pool.buffer_bytes for b in small)
    assert pool.try_acquire(100, "w3") is None  # every ordinary buffer is lent
    with pytest.raises(ValueError, match="needs 11000000 bytes"):
        pool.acquire(11_000_000, "too big")
    pool.release(big)
    assert pool.try_acquire(1_500_000, "lm_head") is not None
    for b in small:
        pool.release(b)
    assert pool.free_count == 3
    fixed = OffloadParamConfig(device="nvme", buffer_count=3, buffer_size=5_000_000)
    assert param_buffer_numels(fixed, numels) == (5_000_000, 0)  # it holds every parameter
