"""Optimizer states on NVMe: the engine's results are bitwise those of the "cpu" tier, the
swap directory is cleaned up, and the NVMe traffic shows in memory_stats."""

from __future__ import annotations

import pytest
import torch
from _engine_models import batches, config, run_engine, tiny_gpt


def _cfg(tmp_path, device: str, dtype: str) -> dict:
    cfg = config(sub_group_size=3000)  # several sub-groups: the pipeline really runs
    cfg["zero_optimization"]["offload_optimizer"] = {"device": device, "nvme_path": str(tmp_path)}
    cfg["gradient_clipping"] = 1.0
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_nvme_optimizer_states_are_bitwise_equal_to_cpu(tmp_path, dtype):
    torch.manual_seed(0)
    model = tiny_gpt(checkpointing=False)
    data = batches(5, seed=3)
    ref_losses, ref = run_engine(model, data, _cfg(tmp_path / "unused", "cpu", dtype))
    got_losses, got = run_engine(model, data, _cfg(tmp_path, "nvme", dtype))
    assert got_losses == ref_losses
    for (name, a), (_, b) in zip(
        got.named_parameters_host(), ref.named_parameters_host(), strict=True
    ):
        assert torch.equal(a, b), name
    stats = got.memory_stats()
    numel = sum(r.numel for r in got.records if r.trainable)
    # Every step reads and writes master, exp_avg and exp_avg_sq (12 bytes per parameter).
    assert stats["nvme_optim_bytes_written"] >= 5 * 12 * numel
    assert stats["nvme_optim_bytes_read"] >= 4 * 12 * numel
    assert any(tmp_path.iterdir())  # the swap directory of this run
    got.close()
    ref.close()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "swap files left behind"


def test_nvme_path_missing_is_a_clear_error(tmp_path):
    import infinity

    cfg = _cfg(tmp_path / "does-not-exist", "nvme", "fp32")
    with pytest.raises((ValueError, OSError), match="does-not-exist"):
        infinity.initialize(tiny_gpt(checkpointing=False), cfg)


def test_a_failed_start_leaves_no_swap_directory(tmp_path, monkeypatch):
    import infinity
    import infinity.engine

    def refuse(*args, **kwargs):
        raise ValueError("refused for the test")

    monkeypatch.setattr(infinity.engine, "PartitionedOptimizer", refuse)
    with pytest.raises(ValueError, match="refused for the test"):
        infinity.initialize(tiny_gpt(checkpointing=False), _cfg(tmp_path, "nvme", "fp32"))
    assert list(tmp_path.iterdir()) == []
