"""Optimizer state split between RAM and NVMe (`offload_optimizer.max_in_cpu`): the first
sub-groups that fit stay in host memory, the rest are swept from NVMe. Where a sub-group
lives changes no value: losses and weights are bitwise those of the all-RAM and all-NVMe
runs, and a checkpoint saved under one split resumes under another exactly."""

from __future__ import annotations

import pytest
import torch
from _engine_models import Zoo, batches, config, run_engine, train_steps

import infinity
from infinity.config.sections import OffloadOptimizerConfig
from infinity.swap.grad_half import HalfGradTier
from infinity.swap.grad_tier import HostGradTier, NvmeGradTier
from infinity.swap.split_state import (
    SplitGradTier,
    SplitStateTier,
    interleaved_order,
    ram_sub_groups,
    state_in_ram,
)
from infinity.swap.state_tier import HostStateTier

SUB_GROUP = 4096  # the Zoo's slots make several sub-groups of this size


def _cfg(
    tmp_path, in_ram: int | None, *, dtype: str = "bf16", accum: int = 1, grads: bool = False
) -> dict:
    """State all in RAM (None), or on NVMe with `in_ram` elements kept in RAM (and with
    `grads` every gradient in RAM)."""
    optim = {"device": "cpu"}
    if in_ram is not None:
        (tmp_path / "swap").mkdir(parents=True, exist_ok=True)
        optim = {"device": "nvme", "nvme_path": str(tmp_path / "swap"), "max_in_cpu": in_ram,
                 "gradients_in_cpu": grads}  # fmt: skip
    cfg = config(sub_group_size=SUB_GROUP, offload_optimizer=optim)
    cfg["gradient_accumulation_steps"] = accum
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def test_the_first_sub_groups_that_fit_whole_stay_in_ram():
    assert ram_sub_groups([10, 10, 5], 0) == 0
    assert ram_sub_groups([10, 10, 5], 19) == 1
    assert ram_sub_groups([10, 10, 5], 20) == 2
    assert ram_sub_groups([10, 10, 5], 10**9) == 3
    assert ram_sub_groups([10, 3, 5], 12) == 1  # a prefix: the third does not jump the second
    nvme = OffloadOptimizerConfig(device="nvme", nvme_path="/x", max_in_cpu=20)
    assert state_in_ram([10, 10, 5], nvme) == 2
    assert state_in_ram([10, 10, 5], OffloadOptimizerConfig(device="cpu")) == 3


def test_the_sweep_steps_host_sub_groups_between_nvme_ones():
    # An NVMe one first, then each tier in proportion, each in ascending order.
    assert interleaved_order(4, 6) == [4, 0, 1, 5, 2, 3]
    assert interleaved_order(1, 3) == [1, 0, 2]
    assert interleaved_order(0, 3) == [0, 1, 2] and interleaved_order(3, 3) == [0, 1, 2]
    for k, n in ((5, 7), (1, 9), (8, 9), (13, 20)):
        order = interleaved_order(k, n)
        assert sorted(order) == list(range(n))
        assert [i for i in order if i < k] == list(range(k))
        host_run = max(len(run) for run in "".join("h" if i < k else "n" for i in order).split("n"))
        assert host_run <= -(-k // (n - k))  # never more host ones in a row than their share


def test_a_split_sweep_keeps_the_disk_busy_between_host_sub_groups(tmp_path):
    torch.manual_seed(0)
    cfg = _cfg(tmp_path, 2 * SUB_GROUP)
    losses, engine = run_engine(Zoo(), batches(2), cfg)
    try:
        store = engine.parts.optimizer.state_tier
        assert isinstance(store, SplitStateTier) and store.in_ram == 2
        visited = [i for i, _ in store.sweep()]
        assert visited == interleaved_order(2, len(store.numels))
        assert visited[0] >= store.in_ram  # the disk's sub-group goes first
    finally:
        engine.close()


@pytest.mark.parametrize(("dtype", "accum"), [("bf16", 1), ("fp32", 2), ("bf16", 4)])
def test_every_split_trains_bitwise_as_all_ram_and_all_nvme(tmp_path, dtype, accum):
    torch.manual_seed(0)
    model = Zoo()
    data = batches(6)
    runs = {}
    placements = (("ram", None, False), ("nvme", 0, False), ("split", 2 * SUB_GROUP, False),
                  ("nvme-grads-in-ram", 0, True))  # fmt: skip
    for name, in_ram, grads in placements:
        cfg = _cfg(tmp_path / name, in_ram, dtype=dtype, accum=accum, grads=grads)
        losses, engine = run_engine(model, data, cfg)
        store = engine.parts.optimizer.state_tier
        if name == "split":
            assert isinstance(store, SplitStateTier) and store.in_ram == 2
            assert store.stats.bytes_read > 0  # the NVMe part was really swept
            # The gradients of the sub-groups kept in RAM stay there; the others spill.
            grads = engine.parts.optimizer.grads
            assert isinstance(grads, SplitGradTier)
            assert [type(t) for t in grads.parts] == [HostGradTier, NvmeGradTier]
            assert grads.parts[0].numels == grads.numels[:2]
        if name == "nvme-grads-in-ram":  # 16-bit gradients kept as they come at accum 1
            kept = HalfGradTier if (dtype, accum) == ("bf16", 1) else HostGradTier
            assert isinstance(engine.parts.optimizer.grads, kept)
        weights = [r.home.read() for r in engine.parts.records]
        runs[name] = (losses, weights, engine.memory_stats())
        engine.close()
    for name in ("nvme", "split", "nvme-grads-in-ram"):
        assert runs[name][0] == runs["ram"][0]  # bitwise
        for a, b in zip(runs[name][1], runs["ram"][1], strict=True):
            assert torch.equal(a, b)
    split, nvme = runs["split"][2], runs["nvme"][2]
    assert split["nvme_optim_bytes_read"] < nvme["nvme_optim_bytes_read"]
    assert split["host_bytes"] > nvme["host_bytes"]  # two sub-groups' state in RAM
    assert 0 < split["nvme_grad_bytes_written"] < nvme["nvme_grad_bytes_written"]


def test_all_of_the_state_fitting_is_the_host_tier(tmp_path):
    torch.manual_seed(0)
    engine = infinity.initialize(Zoo(), _cfg(tmp_path, 10**9))
    try:
        assert isinstance(engine.parts.optimizer.state_tier, HostStateTier)
        assert engine.memory_stats().get("nvme_grad_bytes_written", 0) == 0
    finally:
        engine.close()


@pytest.mark.parametrize(("saved", "resumed"), [(2 * SUB_GROUP, 0), (0, SUB_GROUP), (None, 1)])
def test_a_checkpoint_resumes_exactly_under_another_split(tmp_path, saved, resumed):
    torch.manual_seed(0)
    model = Zoo()
    data = batches(6)
    _, reference = run_engine(model, data, _cfg(tmp_path / "ref", resumed))
    want = [r.home.read() for r in reference.parts.records]
    reference.close()
    _, first = run_engine(model, data[:3], _cfg(tmp_path / "a", saved))
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    torch.manual_seed(1)  # the resumed weights must come from the checkpoint
    second = infinity.initialize(Zoo(), _cfg(tmp_path / "b", resumed))
    second.load_checkpoint(tmp_path / "ckpt")
    train_steps(second, data[3:])
    for a, b in zip((r.home.read() for r in second.parts.records), want, strict=True):
        assert torch.equal(a, b)
    second.close()
