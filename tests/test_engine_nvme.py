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
    numel = sum(r.numel for r in got.parts.records if r.trainable)
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
    import infinity.assemble

    def refuse(*args, **kwargs):
        raise ValueError("refused for the test")

    monkeypatch.setattr(infinity.assemble, "PartitionedOptimizer", refuse)
    with pytest.raises(ValueError, match="refused for the test"):
        infinity.initialize(tiny_gpt(checkpointing=False), _cfg(tmp_path, "nvme", "fp32"))
    assert list(tmp_path.iterdir()) == []


# -- parameters on NVMe ---------------------------------------------------------------------
def _both_cfg(tmp_path, device: str, dtype: str, **zero) -> dict:
    """Both offloads on `device`, a live budget far below the model, a tiny staging pool."""
    cfg = _cfg(tmp_path, device, dtype)
    z = cfg["zero_optimization"]
    z["offload_param"] = {"device": device, "nvme_path": str(tmp_path), "buffer_count": 3}
    z["stage3_max_live_parameters"] = 1500
    z["stage3_param_persistence_threshold"] = 40  # norms and biases stay gathered
    z.update(zero)
    return cfg


def _zoo():
    from _engine_models import Zoo

    torch.manual_seed(1)
    return Zoo(d=16, n=3, ckpt="non-reentrant", lora=True)  # frozen weights too


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_nvme_parameters_are_bitwise_equal_to_cpu(tmp_path, dtype):
    model = _zoo()
    data = batches(5, seed=4)
    ref_losses, ref = run_engine(model, data, _both_cfg(tmp_path / "unused", "cpu", dtype))
    got_losses, got = run_engine(model, data, _both_cfg(tmp_path, "nvme", dtype))
    assert got_losses == ref_losses
    for (name, a), (_, b) in zip(
        got.named_parameters_host(), ref.named_parameters_host(), strict=True
    ):
        assert torch.equal(a, b), name
    assert all(r.home.host_bytes == 0 for r in got.parts.records)  # no weights kept in host memory
    stats = got.memory_stats()
    trainable = sum(r.numel * r.itemsize for r in got.parts.records if r.trainable)
    assert stats["nvme_param_bytes_written"] >= 5 * trainable  # every step's new weights
    assert stats["nvme_param_bytes_read"] > 0
    assert stats["prefetch_hits"] > stats["prefetch_misses"]
    assert stats["nvme_param_wait_us"] > 0 and stats["nvme_optim_wait_us"] >= 0
    assert 0 < stats["param_pool_peak_bytes_in_use"] <= stats["param_pool_bytes"]
    assert 0 < stats["optim_host_buffer_peak_bytes"] <= stats["optim_host_buffer_bytes"]
    assert stats["pinned_bytes"] == stats["peak_pinned_bytes"] == 0  # nothing pins on the CPU
    assert stats["peak_live_param_numel"] <= 1500 + max(r.numel for r in got.parts.records) * 4
    got.close()
    ref.close()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "swap files left behind"


def test_nvme_parameters_checkpoint_and_resume_exactly(tmp_path):
    from _engine_models import train_steps

    import infinity

    model = _zoo()
    data = batches(6, seed=5)
    cfg = _both_cfg(tmp_path / "swap", "nvme", "bf16")
    (tmp_path / "swap").mkdir()
    straight = infinity.initialize(_copy(model), cfg)
    want = train_steps(straight, data)
    first = infinity.initialize(_copy(model), cfg)
    train_steps(first, data[:3])
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    resumed = infinity.initialize(_copy(model), cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert want[3:] == train_steps(resumed, data[3:])
    for (name, a), (_, b) in zip(
        resumed.named_parameters_host(), straight.named_parameters_host(), strict=True
    ):
        assert torch.equal(a, b), name
    # the saved weights are the ones the RAM tier saves from the same run
    ref = infinity.initialize(_copy(model), _both_cfg(tmp_path / "unused", "cpu", "bf16"))
    train_steps(ref, data[:3])
    ref.save_checkpoint(tmp_path / "ref")
    from infinity.checkpoint import load_checkpoint

    a, b = load_checkpoint(tmp_path / "ckpt"), load_checkpoint(tmp_path / "ref")
    assert sorted(a.tensor_names()) == sorted(b.tensor_names())
    for name in a.tensor_names():
        assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    for e in (straight, resumed, ref):
        e.close()


def _copy(model):
    import copy

    return copy.deepcopy(model)
