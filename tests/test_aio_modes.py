"""The `aio` section's single_submit and overlap_events on the native engines: every
combination moves data exactly, and the engine's counters show each setting's effect
(submission calls per op, no new ops while a batch is in flight)."""

from __future__ import annotations

import itertools
import os
import random
import time

import pytest
import torch

from infinity.config.sections import AioConfig
from infinity.io import AioHandle, aio_checks, aligned_empty, available_backends

NATIVE = ["io_uring", "aio"]
MODES = list(itertools.product(NATIVE, [False, True], [True, False]))


def _skip_unless(backend: str) -> None:
    if backend not in available_backends():
        pytest.skip(f"backend {backend} does not run here (extension or kernel)")


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def _handle(backend, single_submit, overlap_events, **kw) -> AioHandle:
    return AioHandle(backend=backend, single_submit=single_submit,
                     overlap_events=overlap_events, **kw)  # fmt: skip


@pytest.mark.parametrize("backend,single_submit,overlap_events", MODES)
def test_every_mode_moves_data_exactly(tmp_path, backend, single_submit, overlap_events):
    _skip_unless(backend)
    rng = random.Random(MODES.index((backend, single_submit, overlap_events)))
    path = tmp_path / "f.bin"
    pieces, offset = [], rng.choice([1, 3, 4095])
    for i in range(12):
        n = rng.choice([1, 4097, rng.randrange(1, 600_000), 1 << 20])
        pieces.append((offset, _random_bytes(n, i)))
        offset += n + rng.randrange(0, 5000)
    with _handle(backend, single_submit, overlap_events, block_size=16 << 10, queue_depth=4,
                 threads=2) as h:  # fmt: skip
        srcs = []
        for i, (off, data) in enumerate(pieces):
            shift = off % 4096 if i % 2 else rng.randrange(0, 4096)  # direct, or not
            src = aligned_empty(len(data) + shift)[shift:]
            src.copy_(data)
            srcs.append(src)
        for f in [h.pwrite(s, path, off) for s, (off, _) in zip(srcs, pieces, strict=True)]:
            f.wait()
        outs = [aligned_empty(len(d) + 4096)[off % 4096 :][: len(d)] for off, d in pieces]
        futures = [h.pread(o, path, off) for o, (off, _) in zip(outs, pieces, strict=True)]
        for f in reversed(futures):
            f.wait()
    for o, (off, d) in zip(outs, pieces, strict=True):
        assert torch.equal(o, d), (off, len(d))


@pytest.mark.parametrize("backend", NATIVE)
def test_single_submit_makes_one_call_per_op(tmp_path, backend):
    _skip_unless(backend)
    nbytes, block, depth = 8 << 20, 64 << 10, 8
    ops = nbytes // block
    buf = aligned_empty(nbytes)
    buf.copy_(_random_bytes(nbytes, 1))
    calls = {}
    for single, overlap in itertools.product([False, True], [True, False]):
        with _handle(backend, single, overlap, block_size=block, queue_depth=depth) as h:
            h.write(buf, tmp_path / "f.bin")
            h.read(buf, tmp_path / "f.bin")
            stats = h.stats()
        assert stats["ops"] >= 2 * ops
        calls[single, overlap] = stats["submit_calls"]
    for overlap in (True, False):
        assert calls[True, overlap] >= 2 * ops, calls
        assert calls[False, overlap] < 2 * ops, calls  # the first batch goes in one call
    assert calls[False, False] <= 2 * 2 * ops // depth, calls  # one call per batch or so


@pytest.mark.parametrize("single_submit", [False, True])
@pytest.mark.parametrize("overlap_events", [True, False])
def test_overlap_events_off_waits_for_the_batch(single_submit, overlap_events):
    """Reads from a pipe stay in flight until bytes are written to it, so the test decides
    when each op completes: after one of the first four, a refill comes at once with
    overlap_events, and only once all four are done without it. (io_uring only: kernel AIO
    blocks in io_submit on a pipe.)"""
    _skip_unless("io_uring")
    engine = aio_checks.make_engine("io_uring", 4096, 4, 1, single_submit, overlap_events)
    r, w = os.pipe()
    buf = aligned_empty(8 * 4096)
    try:
        ticket = engine.submit(False, r, buf.data_ptr(), 8 * 4096, 0)
        _wait_for(lambda: engine.stats()["ops"] == 4)
        os.write(w, b"a" * 4096)
        if overlap_events:
            _wait_for(lambda: engine.stats()["ops"] == 5)
            assert engine.stats()["max_in_flight_at_refill"] == 3
        else:
            time.sleep(0.2)
            assert engine.stats()["ops"] == 4  # three still out: no refill
        os.write(w, b"b" * 7 * 4096)
        assert engine.wait(ticket) is None
        stats = engine.stats()
        assert stats["ops"] == 8
        assert (stats["max_in_flight_at_refill"] > 0) == overlap_events
        assert int(buf.eq(ord("a")).sum()) == 4096  # which op got them is the kernel's pick
        assert int(buf.eq(ord("b")).sum()) == 7 * 4096
    finally:
        engine.close()
        os.close(r)
        os.close(w)


def _wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the engine did not get there in time"
        time.sleep(0.005)


@pytest.mark.parametrize("backend", NATIVE)
def test_no_refill_in_flight_without_overlap(tmp_path, backend):
    _skip_unless(backend)
    data = _random_bytes(6 << 20, 2)
    for single in (False, True):
        with _handle(backend, single, False, block_size=32 << 10, queue_depth=4,
                     threads=2) as h:  # fmt: skip
            futures = [h.pwrite(data[i : i + (1 << 20)].clone(), tmp_path / "f.bin", i)
                       for i in range(0, data.numel(), 1 << 20)]  # fmt: skip
            for f in futures:
                f.wait()
            out = aligned_empty(data.numel())
            h.read(out, tmp_path / "f.bin")
            assert h.stats()["max_in_flight_at_refill"] == 0
        assert torch.equal(out, data)


def test_settings_reach_the_handle_and_posix_accepts_them():
    cfg = AioConfig(single_submit=True, overlap_events=False, backend="posix")
    with AioHandle.from_config(cfg) as h:
        assert (h.single_submit, h.overlap_events) == (True, False)
        assert "single_submit=True, overlap_events=False" in repr(h)
        assert h.stats() == {"submit_calls": 0, "ops": 0, "max_in_flight_at_refill": 0}
    for backend in [b for b in NATIVE if b in available_backends()]:
        with AioHandle.from_config(AioConfig(single_submit=True, backend=backend)) as h:
            assert (h._engine.single_submit, h._engine.overlap_events) == (True, True)
