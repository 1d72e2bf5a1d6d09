"""`infinity.estimate` with ranks: every byte `sizes(..., world_size=2)` gives is what each
of two gloo ranks of the engine holds and moves (its shards of the homes, the optimizer
state and the gradients, in RAM and on disk, and its NVMe reads of them)."""

from __future__ import annotations

import json

import pytest
from _dist import rank_results, run_ranks
from test_estimate import SHAPE, _config, _delta

from infinity.config import Config
from infinity.estimate import model_shape, sizes
from infinity.estimate.sizing import resolve_config
from infinity.models import LlamaConfig


@pytest.mark.parametrize(
    ("param", "optim"),
    [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu"), ("cpu", "nvme-8bit")],
    ids=["both-nvme", "params-cpu-optim-nvme", "params-nvme-optim-cpu", "8-bit-aligned-shards"],
)
def test_two_ranks_hold_and_move_what_the_estimate_says(tmp_path, param, optim):
    """The 8-bit case: shards rounded up to 256 elements, in the estimate as in the engine."""
    eight_bit = optim.endswith("-8bit")
    optim = optim.removesuffix("-8bit")
    cfg = _config(tmp_path, param=param, optim=optim, stage3_max_live_parameters=50000)
    if eight_bit:
        cfg["optimizer"]["type"] = "AdamW8bit"
    args = [str(tmp_path), json.dumps(cfg), "2"]
    ranks = rank_results(run_ranks("_estimate_ranks_child.py", args, timeout_s=240))
    shape = model_shape(LlamaConfig(**SHAPE))
    sz = sizes(shape, resolve_config(Config.load(cfg), shape), pins=False, world_size=2)
    one = sizes(shape, resolve_config(Config.load(cfg), shape), pins=False)
    # each rank steps about half (slots are aligned to 2048 elements: small ones round up)
    assert sz.flat_numel < 0.65 * one.flat_numel
    for out in ranks:
        stats = out["stats"]
        assert out["disk"] == sz.nvme_bytes
        assert stats[-1]["host_bytes"] == sz.host_bytes
        assert stats[-1]["grad_bytes"] == sz.grad_host_bytes
        assert _delta(stats, "nvme_optim_bytes_read") == sz.optim_read_bytes_per_step
        assert _delta(stats, "nvme_optim_bytes_written") == sz.optim_write_bytes_per_step
        assert _delta(stats, "nvme_param_bytes_written") == sz.param_write_bytes_per_step
        assert _delta(stats, "nvme_param_bytes_read") == sz.param_read_bytes_per_micro_step
        assert _delta(stats, "nvme_grad_bytes_read") == sz.grad_read_bytes_per_step
        assert _delta(stats, "nvme_grad_bytes_written") == sz.grad_write_bytes_per_step
