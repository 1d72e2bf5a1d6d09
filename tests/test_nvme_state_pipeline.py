"""offload_optimizer.pipeline_read / pipeline_write / pin_memory: what each switch changes in
the NVMe optimizer sweep, and that the results never change."""

from __future__ import annotations

import pytest
import torch
from _engine_models import batches, config, run_engine, tiny_gpt
from _fake_aio import FakeAio

from infinity.accelerator.cpu import CpuAccelerator
from infinity.config import Config
from infinity.swap import SwapStores, make_state_tier
from infinity.swap.nvme_state import NvmeStateTier
from infinity.swap.state_tier import HostStateTier
from infinity.swap.store import SwapStore

NUMELS = [1000, 3000, 1, 777, 4096, 513]
SWITCHES = [(True, True), (True, False), (False, True), (False, False)]


class InFlightAio(FakeAio):
    """A lazy FakeAio (a request runs when waited for) that knows which requests are in
    flight: issued and not yet waited for."""

    def __init__(self):
        super().__init__(lazy=True)
        self.futures: list[tuple[str, object]] = []

    def pread(self, buf, path, offset=0):
        fut = super().pread(buf, path, offset)
        self.futures.append(("read", fut))
        return fut

    def pwrite(self, buf, path, offset=0):
        fut = super().pwrite(buf, path, offset)
        self.futures.append(("write", fut))
        return fut

    def in_flight(self, op: str) -> int:
        return sum(1 for kind, fut in self.futures if kind == op and not fut.done())


def _sweep_twice(store: NvmeStateTier, aio: InFlightAio) -> list[tuple[int, int]]:
    """(reads, writes) in flight while the caller holds each sub-group, over two sweeps."""
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(store.numels):
        store.initialize(i, torch.randn(n, generator=g))
    seen = []
    for step in (1, 2):
        for i, s in store.sweep():
            seen.append((aio.in_flight("read"), aio.in_flight("write")))
            s.exp_avg.add_(s.master, alpha=0.1 * (i + 1))
            s.exp_avg_sq.addcmul_(s.master, s.master, value=0.01)
            s.master.sub_(s.exp_avg / (s.exp_avg_sq.sqrt() + 1e-8), alpha=1e-3 * step)
    return seen


@pytest.mark.parametrize("read,write", SWITCHES)
def test_each_switch_turns_its_overlap_on_and_off(tmp_path, read, write):
    aio = InFlightAio()
    with SwapStore(tmp_path, run_id="t") as swap:
        # Without checksums: a read's check waits for it on a thread, which runs a lazy read.
        store = NvmeStateTier(NUMELS, store=swap, aio=aio, buffer_count=4, pipeline_read=read,
                              pipeline_write=write, checksums=False)  # fmt: skip
        with store:
            seen = _sweep_twice(store, aio)
            reads_after = aio.in_flight("read")  # the next sweep's read-ahead
    reads_while_stepping = max(r for r, _ in seen)
    writes_while_stepping = max(w for _, w in seen)
    assert (reads_while_stepping > 0) is read
    assert (writes_while_stepping > 0) is write
    assert (reads_after > 0) is read


@pytest.mark.parametrize("read,write", SWITCHES)
def test_results_are_bitwise_those_of_the_host_tier(tmp_path, read, write):
    want_store = HostStateTier(NUMELS)
    _sweep_twice_host(want_store)
    with SwapStore(tmp_path, run_id="t") as swap:
        aio = InFlightAio()
        with NvmeStateTier(
            NUMELS, store=swap, aio=aio, buffer_count=3, pipeline_read=read, pipeline_write=write
        ) as store:
            _sweep_twice(store, aio)
            for i in range(len(NUMELS)):
                got, want = store.read(i), want_store.read(i)
                for a, b in zip(got, want, strict=True):
                    assert torch.equal(a, b), i


def _sweep_twice_host(store: HostStateTier) -> None:
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(store.numels):
        store.initialize(i, torch.randn(n, generator=g))
    for step in (1, 2):
        for i, s in store.sweep():
            s.exp_avg.add_(s.master, alpha=0.1 * (i + 1))
            s.exp_avg_sq.addcmul_(s.master, s.master, value=0.01)
            s.master.sub_(s.exp_avg / (s.exp_avg_sq.sqrt() + 1e-8), alpha=1e-3 * step)


def _engine_cfg(tmp_path, **offload) -> dict:
    cfg = config(sub_group_size=3000)  # several sub-groups: the pipeline really runs
    cfg["zero_optimization"]["offload_optimizer"] = {
        "device": "nvme",
        "nvme_path": str(tmp_path),
        **offload,
    }
    cfg["bf16"] = {"enabled": True}
    return cfg


def test_engine_takes_the_switches_from_the_config_and_trains_bitwise_the_same(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt(checkpointing=False)
    data = batches(3, seed=3)
    results = []
    for read, write in SWITCHES:
        cfg = _engine_cfg(tmp_path, pipeline_read=read, pipeline_write=write)
        losses, engine = run_engine(model, data, cfg)
        store = engine.parts.optimizer.state_tier
        assert (store.pipeline_read, store.pipeline_write) == (read, write)
        results.append((losses, [w.clone() for _, w in engine.named_parameters_host()]))
        engine.close()
    for losses, weights in results[1:]:
        assert losses == results[0][0]
        assert all(torch.equal(a, b) for a, b in zip(weights, results[0][1], strict=True))


class PinningAccelerator(CpuAccelerator):
    """The CPU, claiming to pin (as CUDA does): counts the pinned allocations."""

    def __init__(self):
        super().__init__()
        self.pinned_nbytes = 0

    def pin_supported(self) -> bool:
        return True

    def empty_pinned(self, shape, dtype):
        out = torch.empty(shape, dtype=dtype)
        self.pinned_nbytes += out.nbytes
        return out


@pytest.mark.parametrize("pin", [True, False])
def test_pin_memory_allocates_the_pipeline_buffers_pinned(tmp_path, monkeypatch, pin):
    accel = PinningAccelerator()
    monkeypatch.setattr("infinity.swap.pool.get_accelerator", lambda: accel)
    monkeypatch.setattr("infinity.io.aio.get_accelerator", lambda: accel)
    cfg = Config.load(
        {"zero_optimization": _engine_cfg(tmp_path, pin_memory=pin)["zero_optimization"]}
    )
    with SwapStores() as stores:
        store = make_state_tier(
            NUMELS, cfg.zero_optimization.offload_optimizer, cfg.aio, stores=stores
        )
        with store:
            assert store.pool.pinned is pin
            assert (accel.pinned_nbytes >= store.pool.total_bytes) is pin
            assert store.memory_stats()["optim_host_buffer_pinned_bytes"] == (
                store.pool.total_bytes if pin else 0
            )


def test_pin_memory_on_the_cpu_accelerator_pins_nothing_and_says_so(tmp_path):
    torch.manual_seed(0)
    cfg = _engine_cfg(tmp_path, pin_memory=True)
    _, engine = run_engine(tiny_gpt(checkpointing=False), batches(1, seed=3), cfg)
    try:
        stats = engine.memory_stats()
        assert engine.parts.optimizer.state_tier.pool.pinned is False
        assert stats["optim_host_buffer_pinned_bytes"] == 0
        assert stats["pinned_bytes"] == stats["peak_pinned_bytes"] == 0
    finally:
        engine.close()
