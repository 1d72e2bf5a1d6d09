"""fp32 gradient sums kept on the device across micro batches
(`offload_optimizer.gradients_on_device`): the first sub-groups that fit are added to where
backward made their gradients and read to the host once per step. On the CPU device the
device is host memory, so every path but the CUDA copy runs here. Where a sum lives changes
no value: losses and weights are bitwise those of the host and NVMe tiers."""

from __future__ import annotations

import pytest
import torch
from _engine_models import Zoo, batches, config, run_engine, train_steps

import infinity
from infinity.accelerator import get_accelerator
from infinity.config.sections import OffloadOptimizerConfig
from infinity.swap.grad_device import DeviceGradTier
from infinity.swap.grad_tier import HostGradTier, NvmeGradTier, sum_of_squares
from infinity.swap.split_state import SplitGradTier, grad_split

SUB_GROUP = 4096


def _cfg(tmp_path, *, on_device: int, optim: str = "nvme", in_ram: int = 0,
         dtype: str = "bf16", accum: int = 1) -> dict:  # fmt: skip
    swap = tmp_path / "swap"
    swap.mkdir(parents=True, exist_ok=True)
    offload = {"device": optim, "nvme_path": str(swap), "max_in_cpu": in_ram,
               "gradients_on_device": on_device}  # fmt: skip
    cfg = config(sub_group_size=SUB_GROUP, offload_optimizer=offload)
    cfg["gradient_accumulation_steps"] = accum
    cfg["gradient_clipping"] = 0.5  # the norm decides every update
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def test_the_split_rule_device_then_host_then_nvme():
    def split(**kw) -> tuple[int, int]:
        kw = {"device": "nvme", "nvme_path": "/x", **kw}
        return grad_split([10, 10, 5], OffloadOptimizerConfig(**kw))

    assert split() == (0, 0)
    assert split(gradients_on_device=19) == (1, 1)
    # State of the first two in RAM: their gradients too, past the device's one.
    assert split(max_in_cpu=20, gradients_on_device=10) == (1, 2)
    # The device may hold sums whose state is on NVMe: nothing spills then.
    assert split(gradients_on_device=25) == (3, 3)
    assert split(device="cpu", gradients_on_device=10) == (1, 3)


def test_the_tier_sums_and_measures_as_the_host_tier():
    numels = [5000, 3000, 4000]
    device, host = DeviceGradTier(numels, get_accelerator()), HostGradTier(numels)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for index, n in enumerate(numels):
            src = torch.randn(n - 100, generator=g).to(torch.bfloat16)
            device.add(index, 50, src)
            host.add(index, 50, src)
    assert device.sums_of_squares() == host.sums_of_squares()
    for index in range(3):
        assert torch.equal(device.take(index), host.take(index))
        assert float(sum_of_squares(device.take(index))) > 0
        device.release(index)
        assert not device.take(index).any()  # released: zeros
    stats = device.memory_stats()
    # Two halves of the largest sub-group: the norm copies the next while it measures one.
    assert stats == {"grad_device_bytes": 4 * 12000, "grad_host_bytes": 2 * 4 * 5000}
    device.close()


def test_the_norm_copies_the_next_sub_group_while_it_measures_one(monkeypatch):
    import infinity.swap.grad_device as grad_device

    device, events = DeviceGradTier([300, 200, 100], get_accelerator()), []
    for index, n in enumerate(device.numels):
        device.add(index, 0, torch.full((n,), float(index + 1)))
    to_host, measure = device.accel.to_host, grad_device.sum_of_squares

    def copy(dev, out, stream=None):
        events.append(("copy", dev.numel()))
        return to_host(dev, out=out, stream=stream)

    def measured(flat):
        events.append(("measure", flat.numel()))
        return measure(flat)

    monkeypatch.setattr(device.accel, "to_host", copy)
    monkeypatch.setattr(grad_device, "sum_of_squares", measured)
    values = device.sums_of_squares()
    assert events == [("copy", 300), ("copy", 200), ("measure", 300), ("copy", 100),
                      ("measure", 200), ("measure", 100)]  # fmt: skip
    want = [measure(torch.full((n,), float(i + 1))) for i, n in enumerate(device.numels)]
    assert values == want  # the same bits as measuring each sub-group alone
    device.close()


@pytest.mark.parametrize(
    ("dtype", "accum", "lora"),
    [("bf16", 1, False), ("fp32", 2, False), ("bf16", 4, False), ("bf16", 2, True)],
)
def test_sums_on_the_device_train_bitwise_as_host_and_nvme(tmp_path, dtype, accum, lora):
    torch.manual_seed(0)
    model = Zoo(lora=lora)  # with a frozen base: its weights have no sums anywhere
    data = batches(6)
    placements = {
        "host": dict(on_device=0, optim="cpu"),
        "nvme": dict(on_device=0),
        "all-on-device": dict(on_device=10**9),
        "device-then-nvme": dict(on_device=2 * SUB_GROUP),
        "device-host-nvme": dict(on_device=SUB_GROUP, in_ram=3 * SUB_GROUP),
        "device-state-in-ram": dict(on_device=2 * SUB_GROUP, optim="cpu"),
    }
    runs = {}
    for name, kw in placements.items():
        cfg = _cfg(tmp_path / name, dtype=dtype, accum=accum, **kw)
        losses, engine = run_engine(model, data, cfg)
        grads, stats = engine.parts.optimizer.grads, engine.memory_stats()
        slots = engine.parts.optimizer.device_slots()
        if name == "all-on-device":
            assert isinstance(grads, DeviceGradTier)
            assert slots == frozenset(range(engine.parts.optimizer.num_slots))
            assert stats.get("nvme_grad_bytes_written", 0) == 0
        if name == "device-then-nvme":
            assert [type(t) for t in grads.parts] == [DeviceGradTier, NvmeGradTier]
            assert 0 < len(slots) < engine.parts.optimizer.num_slots
        if name == "device-host-nvme":
            assert isinstance(grads, SplitGradTier)
            assert [type(t) for t in grads.parts] == [DeviceGradTier, HostGradTier, NvmeGradTier]
        if name.startswith(("all", "device")):
            on_device = sum(grads.numels[: grad_split(grads.numels, _offload(cfg))[0]])
            assert stats["grad_device_bytes"] == 4 * on_device > 0
        weights = [r.home.read() for r in engine.parts.records]
        runs[name] = (losses, weights, engine.get_global_grad_norm(), stats)
        engine.close()
    for name in placements:
        assert runs[name][0] == runs["host"][0], name  # bitwise
        assert runs[name][2] == runs["host"][2], name
        for a, b in zip(runs[name][1], runs["host"][1], strict=True):
            assert torch.equal(a, b), name
    # Sums kept on the device are never spilled: fewer gradient bytes over the disk.
    spilled = runs["nvme"][3]["nvme_grad_bytes_written"]
    assert 0 < runs["device-then-nvme"][3]["nvme_grad_bytes_written"] < spilled


@pytest.mark.skipif(get_accelerator().device.type != "cpu", reason="the CPU device's case")
def test_sums_on_the_cpu_device_say_they_stay_in_ram(tmp_path, caplog):
    """On the CPU device the key is honoured (the sums live in the device's memory, host
    RAM) and the run says so, rather than keeping quiet about a GPU setting."""
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="infinity.swap.tiers"):
        _, engine = run_engine(Zoo(), batches(1), _cfg(tmp_path, on_device=SUB_GROUP))
    engine.close()
    assert "on the CPU device the device's memory is host RAM" in caplog.text


def test_an_fp16_overflow_on_the_device_skips_the_step_and_forgets_the_sums(tmp_path):
    """An inf gradient summed on the device: the norm is inf, the step is skipped and the
    sums read as zeros after it, so the next steps train as on the host tier, bit for bit."""
    data = batches(4, seed=12)
    runs = []
    for on_device in (0, 10**9):
        torch.manual_seed(0)
        cfg = _cfg(tmp_path / str(on_device), on_device=on_device, dtype="fp32", accum=2)
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        engine = infinity.initialize(Zoo(), cfg)
        losses = []
        for k, ids in enumerate(data):
            loss = engine(ids, ids)
            engine.backward(loss * float("inf") if k == 1 else loss)  # the first window
            engine.step()
            losses.append(loss.item())
        assert engine.skipped_steps == 1 and engine.global_steps == 2
        runs.append((losses, [r.home.read() for r in engine.parts.records], engine.loss_scale))
        engine.close()
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(a, b)


def _offload(cfg: dict) -> OffloadOptimizerConfig:
    return infinity.Config.load(cfg).zero_optimization.offload_optimizer


def test_a_checkpoint_resumes_exactly_with_the_sums_elsewhere(tmp_path):
    torch.manual_seed(0)
    model = Zoo()
    data = batches(6)
    _, reference = run_engine(model, data, _cfg(tmp_path / "ref", on_device=0, accum=2))
    want = [r.home.read() for r in reference.parts.records]
    reference.close()
    _, first = run_engine(model, data[:4], _cfg(tmp_path / "a", on_device=10**9, accum=2))
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    torch.manual_seed(1)  # the resumed weights must come from the checkpoint
    second = infinity.initialize(Zoo(), _cfg(tmp_path / "b", on_device=SUB_GROUP, accum=2))
    second.load_checkpoint(tmp_path / "ckpt")
    train_steps(second, data[4:])
    for a, b in zip((r.home.read() for r in second.parts.records), want, strict=True):
        assert torch.equal(a, b)
    second.close()


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="gradients_on_device"):
        infinity.Config.load(
            {"zero_optimization": {"offload_optimizer": {"gradients_on_device": -1}}}
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available here")
def test_on_a_gpu_the_sums_and_the_norm_are_the_host_tier_bits():
    from infinity.accelerator.cuda import CudaAccelerator

    numels = [70000, 30000]
    device, host = DeviceGradTier(numels, CudaAccelerator()), HostGradTier(numels)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):  # an accumulation window of bf16 gradients, made on the GPU
        for index, n in enumerate(numels):
            src = torch.randn(n, generator=g).to(torch.bfloat16)
            device.add(index, 0, src.cuda())
            host.add(index, 0, src)
    assert device.memory_stats()["grad_device_bytes"] == 4 * 100000
    assert device.sums_of_squares() == host.sums_of_squares()
    for index in range(2):
        got = device.take(index)
        assert got.is_pinned() and torch.equal(got, host.take(index))
    device.close()


def test_the_slots_kept_on_the_device_lie_wholly_in_its_sub_groups():
    """One rule for the engine (`device_slots`, which routes gradients) and the estimate
    (which backward copies it counts): a slot straddling the last device sub-group is not."""
    from infinity.zero.sub_groups import flat_layout

    layout = flat_layout([1000, 5000, 1000], 4096)
    assert [list(layout.sub_groups_of(i)) for i in range(3)] == [[0], [0, 1], [2]]
    assert layout.slots_within(0) == frozenset()
    assert layout.slots_within(1) == {0}  # slot 1 straddles into sub-group 1
    assert layout.slots_within(2) == {0, 1}
    assert layout.slots_within(3) == {0, 1, 2}
