"""`infinity.estimate` with ranks: every byte `sizes(..., world_size=2)` gives is what each
of two gloo ranks of the engine holds and moves (its shards of the homes, the optimizer
state and the gradients, in RAM and on disk, and its NVMe reads of them)."""

from __future__ import annotations

import json

import pytest
from _dist import rank_results, run_ranks
from _resolve import resolve_config
from test_estimate import SHAPE, _config, _delta

from infinity.config import Config
from infinity.estimate import model_shape, sizes
from infinity.models import LlamaConfig


@pytest.mark.parametrize(
    ("param", "optim", "keep"),
    [
        ("nvme", "nvme", 0),
        ("cpu", "nvme", 0),
        ("nvme", "cpu", 0),
        ("nvme", "nvme", 60000),
        ("cpu", "nvme-8bit", 0),
    ],
    ids=[
        "both-nvme",
        "params-cpu-optim-nvme",
        "params-nvme-optim-cpu",
        "both-nvme-keep",
        "8-bit-aligned-shards",
    ],
)
def test_two_ranks_hold_and_move_what_the_estimate_says(tmp_path, param, optim, keep):
    """`keep`: elements of trainable weights kept across the micro batches of a step (two
    micro batches a step, so what is kept is read once where the rest is read twice), with
    the gradients reduce-scattered in fp32 (communication_data_type; the others in bf16).
    The 8-bit case: shards rounded up to 256 elements, in the estimate as in the engine."""
    eight_bit = optim.endswith("-8bit")
    optim = optim.removesuffix("-8bit")
    cfg = _config(tmp_path, param=param, optim=optim, stage3_max_live_parameters=50000,
                  accum=2 if keep else 1, keep_weights_numel=keep)  # fmt: skip
    if eight_bit:
        cfg["optimizer"]["type"] = "AdamW8bit"
    if keep:
        cfg["communication_data_type"] = "fp32"
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
        accum = cfg["gradient_accumulation_steps"]
        assert _delta(stats, "nvme_param_bytes_read") == sz.param_read_bytes_per_step(accum)
        assert stats[-1]["peak_kept_param_numel"] * sz.itemsize == sz.kept_device_bytes
        assert (sz.kept_read_bytes_per_step > 0) == bool(keep)
        assert _delta(stats, "nvme_grad_bytes_read") == sz.grad_read_bytes_per_step
        assert _delta(stats, "nvme_grad_bytes_written") == sz.grad_write_bytes_per_step
        # the gradient buckets, in the communication dtype: their buffers and what they move
        assert stats[-1]["grad_bucket_bytes"] == sz.grad_bucket_device_bytes > 0
        moved = accum * sz.reduce_scatter_bytes_per_micro_step
        assert _delta(stats, "comm_reduce_scatter_bytes") == moved > 0
    if keep:  # in fp32, twice the bytes of the training dtype's (bf16) buckets
        half = Config.load({**cfg, "communication_data_type": None})
        bf16 = sizes(shape, resolve_config(half, shape), pins=False, world_size=2)
        moved = sz.reduce_scatter_bytes_per_micro_step
        assert moved == 2 * bf16.reduce_scatter_bytes_per_micro_step
        assert sz.grad_bucket_device_bytes == 2 * bf16.grad_bucket_device_bytes
