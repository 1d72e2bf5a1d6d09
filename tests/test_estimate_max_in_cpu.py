"""`infinity.estimate` with `offload_param.max_in_cpu`: the frozen base's first elements keep
their homes in RAM (the engine's `frozen_nvme_mask`), so the estimate's host and disk bytes
and its NVMe reads equal the engine's counters with the prefix in RAM too."""

from __future__ import annotations

import pytest
from _resolve import resolve_config
from test_estimate import SHAPE, _config, _delta, _train

from infinity.config import Config
from infinity.estimate import model_shape, sizes
from infinity.models import LlamaConfig


@pytest.mark.parametrize("max_in_cpu", [0, 40000, 10**9])
def test_a_frozen_prefix_in_ram_is_estimated_exactly(tmp_path, max_in_cpu):
    cfg = _config(tmp_path, sub_group_size=1000, stage3_max_live_parameters=45000)
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
    stats, disk = _train(cfg, tmp_path, lora_r=4)
    shape = model_shape(LlamaConfig(**SHAPE), lora_r=4)
    sz = sizes(shape, resolve_config(Config.load(cfg), shape), pins=False)
    assert disk == sz.nvme_bytes
    assert stats[-1]["host_bytes"] == sz.host_bytes
    assert _delta(stats, "nvme_param_bytes_read") == sz.param_read_bytes_per_micro_step
    assert _delta(stats, "nvme_optim_bytes_read") == sz.optim_read_bytes_per_step
    moved = sz.gather_bytes_per_micro_step + sz.grad_offload_bytes_per_micro_step
    assert _delta(stats, "host_device_bytes") == moved + sz.refresh_bytes_per_step
    if max_in_cpu == 40000:  # part of the base in RAM, part on NVMe
        assert sz.frozen_host_bytes > 0 and sz.param_read_bytes_per_micro_step > 0
