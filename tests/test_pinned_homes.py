"""Host homes are pinned where the device can pin (offload_param.pin_memory, the default):
every gather copies from them, and a copy from pageable memory runs at a fraction of the
bus's rate and blocks the host while it does (seen on an H100: 9 GB/s pageable against 48
GB/s pinned for a 1B model's gathers). The trainable homes are ranges of the optimizer's
16-bit weight buffer, so that buffer is allocated pinned; the engine's `pinned_bytes` and the
estimate's count the homes."""

from __future__ import annotations

import pytest
import torch
from _engine_models import Zoo, config
from _resolve import resolve_config

import infinity
from infinity.accelerator import CpuAccelerator
from infinity.config import Config
from infinity.estimate.shapes import model_shape
from infinity.estimate.sizing import sizes
from infinity.swap.state_tier import HostStateTier
from infinity.zero.sub_groups import flat_layout
from infinity.zero.weights import make_weights


class RecordingPins(CpuAccelerator):
    """A CPU device that says it can pin and records what it was asked to pin."""

    def __init__(self) -> None:
        super().__init__(alias_host=False)
        self.pinned: list[torch.Tensor] = []

    def pin_supported(self) -> bool:
        return True

    def empty_pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.full(shape, 7, dtype=dtype)  # garbage, as fresh memory holds
        self.pinned.append(t)
        return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_16_bit_weight_buffer_is_allocated_pinned_and_zeroed(dtype):
    layout = flat_layout([3000, 5000, 7], 4096)
    state = HostStateTier(layout.sub_group_numels)
    pins = RecordingPins()
    weights = make_weights(layout, ["a", "b", "c"], dtype, state_tier=state, pin=pins)
    assert len(pins.pinned) == 1 and weights.flat is pins.pinned[0]
    assert weights.flat.numel() == layout.total and weights.flat.dtype == dtype
    assert not weights.flat.any()  # padding must read as zeros
    # Asked not to pin, or on a device that cannot: pageable.
    plain = make_weights(layout, ["a", "b", "c"], dtype, state_tier=state)
    assert plain.flat.numel() == layout.total and len(pins.pinned) == 1
    unpinned = make_weights(layout, ["a", "b", "c"], dtype, state_tier=state, pin=CpuAccelerator())
    assert not unpinned.flat.is_pinned() and len(pins.pinned) == 1


def test_fp32_weights_are_the_masters_and_not_pinned_again():
    layout = flat_layout([3000, 5000], 4096)
    state = HostStateTier(layout.sub_group_numels)
    pins = RecordingPins()
    weights = make_weights(layout, ["a", "b"], torch.float32, state_tier=state, pin=pins)
    assert weights.flat is state.flat.master and not pins.pinned


@pytest.mark.parametrize("pin_memory", [True, False])
def test_the_engine_pins_its_weight_buffer_as_the_config_asks(pin_memory):
    torch.manual_seed(0)
    cfg = config(offload_param={"device": "cpu", "pin_memory": pin_memory})
    cfg["bf16"] = {"enabled": True}
    pins = RecordingPins()
    engine = infinity.initialize(Zoo(), cfg, accelerator=pins)
    try:
        flat = engine.parts.optimizer.weights.flat
        assert any(t is flat for t in pins.pinned) == pin_memory
    finally:
        engine.close()


def test_the_estimate_counts_pinned_homes_on_a_gpu():
    from transformers import LlamaConfig

    shape = model_shape(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4),
        lora_r=4,
    )  # fmt: skip
    raw = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    cfg = resolve_config(Config.load(raw), shape)
    sz = sizes(shape, cfg, pins=True)
    assert sz.pinned_bytes == sz.weights_host_bytes + sz.frozen_host_bytes > 0
    assert sizes(shape, cfg, pins=False).pinned_bytes == 0
    raw["zero_optimization"]["offload_param"] = {"pin_memory": False}
    assert sizes(shape, resolve_config(Config.load(raw), shape), pins=True).pinned_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available here")
def test_on_a_gpu_every_host_home_is_pinned_and_counted():
    from infinity.accelerator.cuda import CudaAccelerator

    torch.manual_seed(0)
    cfg = {**config(), "bf16": {"enabled": True}}
    engine = infinity.initialize(Zoo(), cfg, accelerator=CudaAccelerator())
    try:
        homes = [r.home for r in engine.parts.records]
        assert all(h.flat.is_pinned() for h in homes)
        assert engine.memory_stats()["pinned_bytes"] == (
            engine.parts.optimizer.weights.flat.nbytes
            + sum(r.home.host_bytes for r in engine.parts.records if not r.trainable)
        )
    finally:
        engine.close()
