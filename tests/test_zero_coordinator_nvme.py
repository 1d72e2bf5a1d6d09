"""The coordinator over NVMe homes: gathered values equal the weights written, the live budget
and the tiny pool hold, prefetch hits after the first iteration, no deadlock when a unit has
more parameters than pool buffers, refresh of gathered parameters after their homes changed,
read failures, and the same fetch / LIVE / release decisions however fast the disk is."""

from __future__ import annotations

import pytest
import torch
from _fake_aio import DelayedAio, FakeAio
from torch import nn

from infinity.accelerator import CpuAccelerator
from infinity.config import ZeroConfig
from infinity.io.aio import AioHandle
from infinity.io.aio_checks import available_backends
from infinity.swap.param_tier import NvmeParamError, NvmeParamTier
from infinity.swap.pool import PinnedBufferPool
from infinity.swap.store import SwapStore, align_up
from infinity.zero import (
    Coordinator,
    HomeTier,
    HostHome,
    ModuleUnit,
    NvmeHome,
    OffloadParam,
    ParamState,
)

LAYERS = 5
SHAPES = [(30, 70), (2049,), (5,)]  # per layer: three parameters, odd sizes
DT = torch.float16
HOST = "l0.p1"  # the one parameter whose home stays in host memory


class Model:
    """Records with NVMe homes: trainable ones in the flat space (written with write_flat
    as the optimizer does), the last layer frozen in its own extents; one HOST parameter
    and one persistent parameter in the first unit."""

    def __init__(self, swap, aio, *, buffers, seed=0, alias=True):
        self.accel = CpuAccelerator(alias_host=alias)
        self.pool = PinnedBufferPool(buffers, align_up(2049 * 2), timeout_s=5.0)
        self.ps = NvmeParamTier(store=swap, aio=aio, pool=self.pool)
        g = torch.Generator().manual_seed(seed)
        names = [(f"l{i}.p{j}", s) for i in range(LAYERS) for j, s in enumerate(SHAPES)]
        self.weights = {n: torch.randn(s, generator=g).to(DT) for n, s in names}
        flat_names = [n for n, _ in names if not n.startswith(f"l{LAYERS - 1}.") and n != HOST]
        entries, at = {}, 0
        for n in flat_names:
            entries[n] = (at, self.weights[n].numel())
            at += align_up(self.weights[n].numel(), 2048)
        self.ps.reserve_flat(entries, at, DT)
        frozen = [n for n, _ in names if n not in entries and n != HOST]
        self.ps.reserve({n: (self.weights[n].numel(), DT) for n in frozen})
        self.flat = torch.zeros(at, dtype=DT)
        for n, (off, k) in entries.items():
            self.flat[off : off + k] = self.weights[n].reshape(-1)
        self.entries = entries
        self.ps.write_flat(0, self.flat)
        self.records = {}
        for n, _ in names:
            param = nn.Parameter(torch.empty(0, dtype=DT))
            param.data = self.weights[n].clone()
            if n == HOST:
                home = HostHome(param.detach().reshape(-1).clone(), name=n)
            else:
                home = NvmeHome(self.ps, n)
                if n not in entries:
                    home.write(param.detach())
            rec = OffloadParam(n, param, home, device=self.accel.device, persistent=n == "l0.p2")
            rec.offload()
            if n in entries or n == HOST:  # trainable: the optimizer has a slot for it
                rec.slot = len(self.records)
            self.records[n] = rec
        self.units = [
            ModuleUnit(f"l{i}", [self.records[f"l{i}.p{j}"] for j in range(len(SHAPES))])
            for i in range(LAYERS)
        ]
        self.total = sum(r.numel for r in self.records.values())

    def coordinator(self, budget, prefetch):
        zero = ZeroConfig(
            max_live_parameters=budget, prefetch_bucket_size=prefetch, max_reuse_distance=0
        )
        return Coordinator(self.records.values(), zero, accelerator=self.accel)

    def iterate(self, c, check=True):
        """Forward over the units, then backward in reverse, as the engine's hooks do."""
        c.begin_forward("train")
        largest = max(u.numel for u in self.units)
        for i, unit in enumerate([*self.units, *reversed(self.units)]):
            if i == len(self.units):
                c.end_forward(backward=True)
                c.begin_backward()
            pos = c.gather(unit)
            for rec in unit.records:
                assert rec.state is ParamState.LIVE
                # Only a host home is aliased, and only where the device shares host memory.
                assert rec.aliased is (self.accel.shares_host_memory and rec.name == HOST)
                if check:
                    assert torch.equal(rec.param.detach(), self.weights[rec.name]), rec.name
            assert c.live_numel <= c.budget + largest
            assert self.pool.peak_bytes_in_use <= self.pool.total_bytes
            c.done(unit, pos)
        c.end_backward()
        assert self.pool.free_count == self.pool.buffer_count  # no buffer left behind

    def step(self, scale):
        """What the optimizer does: new weights of every trainable parameter written back."""
        for n, (off, k) in self.entries.items():
            self.weights[n] = (self.weights[n].float() * scale).to(DT)
            self.flat[off : off + k] = self.weights[n].reshape(-1)
        for start in range(0, self.flat.numel(), 4096):
            self.ps.write_flat(start, self.flat[start : start + 4096])
        self.ps.flush()
        self.weights[HOST] = (self.weights[HOST].float() * scale).to(DT)
        self.records[HOST].home.write(self.weights[HOST])

    def refresh(self, c):
        """What the engine does after a step: every trainable record's home changed."""
        for rec in self.records.values():
            if rec.trainable:
                c.refresh(rec)


def _hit_rate(c, before):
    hits = c.hits - before[0]
    misses = c.misses - before[1]
    return hits / max(hits + misses, 1)


@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copied"])
@pytest.mark.parametrize("buffers", [1, 2, 4])
def test_values_budget_pool_and_prefetch_hits(swap, buffers, alias):
    m = Model(swap, FakeAio(), buffers=buffers, alias=alias)
    c = m.coordinator(budget=m.total * 3 // 5, prefetch=m.total // 4)
    assert all(r.home.tier is HomeTier.NVME for n, r in m.records.items() if n != HOST)
    m.iterate(c)
    first = (c.hits, c.misses)
    assert c.misses > 0
    for _ in range(2):
        m.iterate(c)
    # Finished reads are landed to make room for more prefetch, so the pool does not cap it.
    assert _hit_rate(c, first) == 1.0, (c.hits - first[0], c.misses - first[1])
    assert c.budget_overruns == 0
    assert c.peak_live_numel <= c.budget + max(u.numel for u in m.units)
    assert m.ps.stats.bytes_read > 0 and m.pool.peak_bytes_in_use > 0
    assert m.accel.copies.host_to_device_bytes > 0  # NVMe gathers copy their pool buffers


@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copied"])
@pytest.mark.parametrize("buffers", [1, 2])
def test_slow_disk_tiny_pool_never_deadlocks(swap, buffers, alias):
    """Reads land only when waited: prefetch stops at a full pool, gathers complete the
    oldest read to get a buffer (a unit has three parameters, the pool one or two)."""
    m = Model(swap, FakeAio(lazy=True), buffers=buffers, alias=alias)
    c = m.coordinator(budget=m.total // 2, prefetch=m.total // 3)
    m.iterate(c)  # no trace yet: a gather reads the unit's parameters together
    assert m.pool.peak_bytes_in_use == buffers * m.pool.buffer_bytes
    first = (c.hits, c.misses)
    m.iterate(c)
    m.step(0.5)
    m.refresh(c)
    m.iterate(c)
    rate = _hit_rate(c, first)
    assert 0.3 < rate < 1.0, rate  # prefetch covered what the pool let it (a third per buffer)
    assert c.budget_overruns == 0
    assert m.pool.peak_bytes_in_use <= buffers * m.pool.buffer_bytes


@pytest.mark.parametrize("backend", available_backends())
def test_real_io_after_optimizer_steps(swap, backend):
    with AioHandle(block_size=8192, queue_depth=4, backend=backend) as aio:
        m = Model(swap, aio, buffers=2)
        c = m.coordinator(budget=m.total // 3, prefetch=m.total // 4)
        m.iterate(c)
        for scale in (-2.0, 0.25):
            m.step(scale)
            m.refresh(c)
            assert torch.equal(m.records["l0.p2"].param.detach(), m.weights["l0.p2"])
            m.iterate(c)
        m.ps.close()


def test_refresh_lands_a_persistent_read_in_flight(swap):
    m = Model(swap, FakeAio(lazy=True), buffers=1)
    c = m.coordinator(budget=m.total, prefetch=0)
    rec = m.records["l0.p2"]
    c._fetch(rec)  # as prefetch would
    c._reads.pump()
    assert rec.state is ParamState.INFLIGHT
    m.step(3.0)  # its read lands first, with the old weights
    m.refresh(c)
    assert rec.state is ParamState.LIVE and torch.equal(rec.param.detach(), m.weights["l0.p2"])
    assert m.pool.free_count == 1 and c.live_numel == rec.numel


def test_read_error_during_gather(swap):
    aio = FakeAio(lazy=True)
    m = Model(swap, aio, buffers=2)
    c = m.coordinator(budget=m.total, prefetch=m.total)
    m.iterate(c)  # records the trace
    aio.fail_read = aio.reads + 1  # the second read of the next iteration
    c.begin_forward("train")
    with pytest.raises(NvmeParamError, match=r"parameter 'l\d\.p\d' .*param\.\d\.swp") as e:
        for unit in m.units:
            c.done(unit, c.gather(unit))
    name = str(e.value).split("'")[1]
    rec = m.records[name]
    assert rec.state is ParamState.RELEASED and rec.device_tensor is None
    c.abort()
    assert m.pool.free_count == 2
    live = [r for r in m.records.values() if r.state is not ParamState.RELEASED]
    assert c.live_numel == sum(r.numel for r in live)
    m.iterate(c)  # the next iteration reads it again


@pytest.mark.parametrize("buffers", [1, 2])
def test_gather_off_the_trace_with_the_pool_full(swap, buffers):
    """Reads prefetched for the unit the trace predicts hold every buffer when another unit
    is gathered: the gather completes them first instead of waiting for the pool forever."""
    m = Model(swap, FakeAio(lazy=True), buffers=buffers)
    c = m.coordinator(budget=m.total, prefetch=m.total)
    m.iterate(c)
    c.begin_forward("train")  # prefetches along the trace: unit 0 first
    assert m.pool.free_count == 0
    for unit in reversed(m.units):
        pos = c.gather(unit)
        for rec in unit.records:
            assert torch.equal(rec.param.detach(), m.weights[rec.name]), rec.name
        c.done(unit, pos)
    c.end_forward(backward=False)
    assert m.pool.free_count == buffers
    m.iterate(c)  # the order changed back: the trace follows


def _decisions(tmp_path, name, aio, *, buffers, check=True):
    """Every LiveEvent of three iterations, an optimizer step and one more iteration."""
    (tmp_path / name).mkdir()
    with SwapStore(tmp_path / name, run_id="t") as swap:
        m = Model(swap, aio, buffers=buffers)
        c = m.coordinator(budget=m.total * 3 // 5, prefetch=m.total // 3)
        log: list[tuple[str, str]] = []
        c.observers.append(lambda event, rec: log.append((event.value, rec.name)))
        for _ in range(3):
            m.iterate(c, check=check)
        c.quiesce()
        m.step(0.5)
        m.refresh(c)
        m.iterate(c, check=check)
        m.ps.close()
    return log, c


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("buffers", [1, 2, 4])
def test_decisions_do_not_depend_on_disk_timing(tmp_path, monkeypatch, buffers, early):
    """Reads finishing at once, only when waited for, or after random delays: the sequence
    of fetches, LIVE transitions and releases is the same (across ranks, the LIVE ones are
    all-gathers, which must come in the same order everywhere). Without `early`, no read
    may be finished before its landing (as when landing is itself a collective)."""
    if not early:
        monkeypatch.setattr(OffloadParam, "finish_read", lambda self, accel: False)
    want, fast = _decisions(tmp_path, "eager", FakeAio(), buffers=buffers)
    assert {e for e, _ in want} == {"fetch", "live", "release"}
    lazy, _ = _decisions(tmp_path, "lazy", FakeAio(lazy=True), buffers=buffers)
    assert lazy == want
    for seed in (1, 2):
        got, c = _decisions(tmp_path, f"delayed{seed}", DelayedAio(FakeAio(), seed=seed),
                            buffers=buffers)  # fmt: skip
        assert got == want, seed
        assert c.hits > 0 and c.budget_overruns == 0
    assert fast.hits > (fast.misses if early else 0)  # prefetch still works


def test_prefetch_does_not_stop_at_a_full_pool(swap):
    """The prefetch window is a function of the trace and the budget: with one pool buffer
    and a disk that never finishes on its own, the reads beyond the first wait in a queue
    and are counted as fetched (against the budget) all the same."""
    m = Model(swap, FakeAio(lazy=True), buffers=1)
    c = m.coordinator(budget=m.total, prefetch=m.total)
    m.iterate(c)
    c.begin_forward("train")
    fetched = [r for r in m.records.values() if r.state is not ParamState.RELEASED]
    assert m.pool.free_count == 0
    assert c.live_numel > sum(r.numel for r in fetched)  # queued reads count too
    reads = [r for r in fetched if r.state is ParamState.INFLIGHT and r.name != HOST]
    assert len(reads) == 1  # the one read the pool takes
    c.abort()
    assert c.live_numel == sum(
        r.numel for r in m.records.values() if r.state is not ParamState.RELEASED
    )
