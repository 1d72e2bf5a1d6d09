"""Parameter homes: the host and NVMe tiers behind one contract, and the engine building every
record with its final home before the optimizer (trainable homes share its buffers)."""

from __future__ import annotations

import pytest
import torch
from _engine_models import Zoo, batches, config, train_steps
from _fake_aio import FakeAio

import infinity
from infinity.accelerator import CpuAccelerator
from infinity.swap.param_tier import NvmeParamTier
from infinity.swap.pool import PinnedBufferPool
from infinity.swap.store import SwapStore
from infinity.zero import HomeTier, HostHome, NvmeHome


@pytest.fixture
def nvme_home(tmp_path):
    with SwapStore(tmp_path, run_id="t") as swap:
        ps = NvmeParamTier(store=swap, aio=FakeAio(lazy=True), pool=PinnedBufferPool(1, 8192))
        ps.reserve({"w": (1000, torch.bfloat16)})
        yield NvmeHome(ps, "w"), ps


def _homes(nvme_home):
    host = HostHome(torch.zeros(1000, dtype=torch.bfloat16), name="w")
    return [host, nvme_home[0]]


@pytest.mark.parametrize("tier", [HomeTier.HOST, HomeTier.NVME])
def test_one_contract_for_both_tiers(nvme_home, tier):
    home = {h.tier: h for h in _homes(nvme_home)}[tier]
    accel = CpuAccelerator()
    assert home.numel == 1000 and home.dtype == torch.bfloat16
    assert home.host_bytes == (2000 if tier is HomeTier.HOST else 0)
    values = torch.linspace(-3, 3, 1000)
    home.write(values.reshape(10, 100))  # fp32 in any shape: stored flat in bf16
    got = home.read()
    assert got.shape == (1000,) and torch.equal(got, values.bfloat16())
    fetch = home.fetch(accel, accel.current_stream())
    assert fetch.reading is (tier is HomeTier.NVME)
    dev, event = fetch.land(accel)
    event.synchronize()
    assert torch.equal(dev, values.bfloat16()) and dev.data_ptr() != got.data_ptr()
    out = torch.zeros(1000, dtype=torch.bfloat16)
    dev, _ = home.fetch(accel, accel.current_stream(), out=out).land(accel)
    assert dev is out and torch.equal(out, values.bfloat16())
    home.fetch(accel, accel.current_stream()).cancel()  # lands, gives its buffer back
    with pytest.raises(ValueError, match="999 elements, the home holds 1000"):
        home.write(torch.zeros(999))


def test_nvme_fetch_without_a_buffer_issues_nothing(nvme_home):
    home, ps = nvme_home
    accel = CpuAccelerator()
    home.write(torch.ones(1000))
    held = home.fetch(accel, accel.current_stream())
    assert home.fetch(accel, accel.current_stream(), block=False) is None
    assert ps.pool.free_count == 0
    held.cancel()
    assert ps.pool.free_count == 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainable_homes_are_the_optimizers_weights(precision):
    cfg = config()
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    engine = infinity.initialize(Zoo(), cfg)
    opt = engine.parts.optimizer
    for rec in engine.parts.records:
        assert isinstance(rec.home, HostHome) and rec.home.numel == rec.numel
        view = opt.home(rec.slot)
        assert rec.home.flat.data_ptr() == view.data_ptr()  # one copy, written by the step
    train_steps(engine, batches(2, seed=3))
    for rec in engine.parts.records:
        assert torch.equal(rec.home.read(), opt.home(rec.slot))
    engine.close()


def test_nvme_engine_builds_nvme_homes_once(tmp_path):
    cfg = config()
    z = cfg["zero_optimization"]
    z["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    torch.manual_seed(0)
    model = Zoo()
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("norm"))
    engine = infinity.initialize(model, cfg)
    homes = {r.name: r.home for r in engine.parts.records}
    assert all(isinstance(h, NvmeHome) for h in homes.values())
    frozen = [r for r in engine.parts.records if not r.trainable]
    assert frozen and all(homes[r.name].key == r.name for r in frozen)  # own extents
    train_steps(engine, batches(2, seed=3))
    assert {r.name: r.home for r in engine.parts.records} == homes  # never moved
    engine.close()
