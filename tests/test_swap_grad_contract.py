"""The gradient tiers' contract: every implementation is a `GradTier`, and what the optimizer
asks of one instead of its type (`on_device`, `host_resident`, `host_flat`) says where its
sums are."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import infinity.swap
from infinity.accelerator import get_accelerator
from infinity.config.sections import AioConfig
from infinity.swap import GradTier, SwapStore
from infinity.swap.grad_device import DeviceGradTier
from infinity.swap.grad_half import HalfGradTier
from infinity.swap.grad_tier import HostGradTier, NvmeGradTier
from infinity.swap.split_state import SplitGradTier
from infinity.zero.optimizer_checks import check_grad_tier
from infinity.zero.sub_groups import flat_layout

AIO = AioConfig(backend="posix", block_size=1 << 16, queue_depth=4)
NUMELS = [4096, 4096, 2048]


def _tiers(store: SwapStore) -> dict[str, GradTier]:
    """One of each implementation over NUMELS (a split: device, host, NVMe)."""
    accel = get_accelerator()
    split = [
        (1, DeviceGradTier(NUMELS[:1], accel)),
        (1, HostGradTier(NUMELS[1:2])),
        (1, NvmeGradTier(NUMELS[2:], store=store, aio=AIO, kind="grad.split")),
    ]
    return {
        "HostGradTier": HostGradTier(NUMELS),
        "HalfGradTier": HalfGradTier(NUMELS, torch.bfloat16),
        "NvmeGradTier": NvmeGradTier(NUMELS, store=store, aio=AIO),
        "DeviceGradTier": DeviceGradTier(NUMELS, accel),
        "SplitGradTier": SplitGradTier(NUMELS, split),
    }


def _implementations() -> set[str]:
    """Every class of infinity.swap named ...GradTier, the contract itself aside."""
    names = set()
    for info in pkgutil.iter_modules(infinity.swap.__path__, "infinity.swap."):
        module = importlib.import_module(info.name)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if name.endswith("GradTier") and cls.__module__ == info.name and cls is not GradTier:
                names.add(name)
    return names


@pytest.fixture
def tiers(tmp_path):
    with SwapStore(str(tmp_path), run_id="t") as store:
        made = _tiers(store)
        yield made
        for tier in made.values():
            tier.close()


def test_every_implementation_is_a_grad_tier(tiers):
    assert set(tiers) == _implementations(), "a gradient tier this test does not check"
    for name, tier in tiers.items():
        assert isinstance(tier, GradTier), name
        assert tier.numels == NUMELS, name
    assert not isinstance(object(), GradTier)


def test_the_contract_says_where_the_sums_are(tiers):
    on_host = {"HostGradTier", "HalfGradTier"}
    for name, tier in tiers.items():
        expected = [name in on_host] * len(NUMELS)
        if name == "SplitGradTier":
            expected = [False, True, False]  # device, host, NVMe
        assert tier.host_resident() == expected, name
        assert tier.on_device == {"DeviceGradTier": 3, "SplitGradTier": 1}.get(name, 0), name
        flat = tier.host_flat()
        if name == "HostGradTier":
            assert flat is tier.flat and flat.numel() == sum(NUMELS)
        else:
            assert flat is None, name


def test_the_device_slots_follow_on_device(tiers):
    """What the hooks add on the device: the slots wholly within the device sub-groups."""
    layout = flat_layout([4096, 6144], 4096)  # the second slot spans sub-groups 1 and 2
    assert layout.sub_group_numels == NUMELS
    for name, tier in tiers.items():
        slots = layout.slots_within(tier.on_device)
        want = {"DeviceGradTier": {0, 1}, "SplitGradTier": {0}}.get(name, set())
        assert slots == want, name


def test_an_object_without_the_contract_is_refused():
    with pytest.raises(TypeError, match="expected a GradTier"):
        check_grad_tier(object(), NUMELS)  # type: ignore[arg-type]
