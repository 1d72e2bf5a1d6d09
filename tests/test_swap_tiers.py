"""Building the tiers from config sections: host vs NVMe, one shared swap store, checks."""

from __future__ import annotations

import os

import pytest
import torch

from infinity.config import Config, RunFacts, resolve_run
from infinity.config.sections import (
    AioConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)
from infinity.swap.nvme_state import NvmeStateTier
from infinity.swap.state_tier import HostStateTier
from infinity.swap.store import SwapStoreError
from infinity.swap.tiers import (
    SwapStores,
    check_host_buffers,
    make_param_tier,
    make_state_tier,
)

AIO = AioConfig(backend="posix", block_size=1 << 16, queue_depth=4)


def test_cpu_offload_is_the_host_tier(tmp_path):
    with SwapStores() as stores:
        s = make_state_tier([3, 4], OffloadOptimizerConfig(device="cpu"), AIO, stores=stores)
        assert isinstance(s, HostStateTier)
    assert os.listdir(tmp_path) == []


def test_both_nvme_tiers_share_one_store(tmp_path):
    opt = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=3)
    loaded = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=2)
    config = Config(zero_optimization=ZeroConfig(offload_param=loaded))  # buffer_size "auto"
    par = resolve_run(config, RunFacts(param_numels=(1000, 10))).zero_optimization.offload_param
    with SwapStores(run_id="r") as stores:
        state = make_state_tier([100, 50], opt, AIO, stores=stores)
        # buffer_count 3, but two sub-groups use no more than two buffers
        assert isinstance(state, NvmeStateTier) and state.pool.buffer_count == 2
        params = make_param_tier(
            {"a.w": (1000, torch.bfloat16), "b.w": (10, torch.bfloat16)}, par, AIO, stores=stores
        )
        assert state.store is params.store
        assert params.pool.buffer_count == 2 and params.pool.buffer_bytes >= 2000
        params.swap_out("a.w", torch.ones(1000, dtype=torch.bfloat16)).wait()
        f = params.swap_in("a.w")
        assert torch.all(f.wait() == 1)
        params.release(f)
        state.close()
        params.close()
    assert os.listdir(tmp_path) == []


def test_too_small_disk_fails_before_training(tmp_path, monkeypatch):
    from infinity.swap import store as store_mod

    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1

    monkeypatch.setattr(store_mod.os, "statvfs", lambda p: Small(real(p)))
    opt = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path))
    with SwapStores() as stores, pytest.raises(SwapStoreError, match="needs 12288 bytes"):
        make_state_tier([1000], opt, AIO, stores=stores)


def test_missing_nvme_path_fails_before_training(tmp_path):
    opt = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path / "nope"))
    with SwapStores() as stores, pytest.raises(SwapStoreError, match="does not exist"):
        make_state_tier([1000], opt, AIO, stores=stores)


def test_host_buffers_larger_than_half_the_ram_are_refused(tmp_path):
    check_host_buffers(4 * 12 * 100, ram_bytes=10_000)
    with pytest.raises(ValueError, match="sub_group_size"):
        check_host_buffers(4 * 12 * 1000, ram_bytes=10_000)
    opt = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=4)
    with SwapStores() as stores, pytest.raises(ValueError, match="GiB of RAM"):
        make_state_tier([10**12], opt, AIO, stores=stores)  # 12 TB per buffer
