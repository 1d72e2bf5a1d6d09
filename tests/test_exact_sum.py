"""The global norm's sum is exact, so its order cannot matter: `ExactSum` against a rational
reference, and one rank's gradient norm against the same gradients sharded over 2-4 ranks,
on every gradient tier, at any torch thread count (see [Note: the norm's order] in
infinity/swap/grad_tier.py)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from infinity.accelerator import get_accelerator
from infinity.config.sections import AioConfig
from infinity.swap.grad_device import DeviceGradTier
from infinity.swap.grad_tier import HostGradTier, NvmeGradTier, row_norms, tail_norm
from infinity.swap.split_state import SplitGradTier
from infinity.swap.store import SwapStore
from infinity.utils.exact_sum import ExactSum
from infinity.zero.shard import shard_align, shard_of
from infinity.zero.sub_groups import flat_layout

AIO = AioConfig(backend="posix", block_size=1 << 16, queue_depth=4)
_KINDS = (f"grad.{i}" for i in itertools.count())
"""A swap store kind of its own for each NVMe tier of a test."""


def _wide(n: int, seed: int) -> torch.Tensor:
    """n fp32 values over the whole fp32 range, subnormals and zeros included."""
    g = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-149, 64, (n,), generator=g).float()
    values = torch.rand(n, generator=g) * torch.exp2(exponent)
    values[::7] = 0.0
    return values


@pytest.mark.parametrize("n", [0, 1, 2, 1000, (1 << 15) + 3, 3 << 15])
def test_exact_sum_is_the_rational_sum_of_squares_rounded_once(n):
    smallest = [2.0**-149, 2.0**-126, 3.4e38] * (n > 0)  # subnormal, smallest normal, largest
    values = torch.cat([_wide(n, 0), torch.tensor(smallest, dtype=torch.float32)])
    want = float(sum((Fraction(x) ** 2 for x in values.tolist()), Fraction(0)))
    got = ExactSum.of_squares(values)
    assert got.value() == want == math.fsum(x * x for x in values.double().tolist())
    perm = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(1))]
    third = perm.numel() // 3
    grouped = ExactSum.of_squares(perm[:third]) + ExactSum.of_squares(perm[third:])
    assert grouped == got  # the same bins, whatever the order or grouping
    assert ExactSum.of_squares(torch.cat([values, torch.zeros(5000)])) == got  # zeros: nothing


def test_exact_sum_propagates_inf_and_nan():
    def of(*xs):
        return ExactSum.of_squares(torch.tensor(xs, dtype=torch.float32)).value()

    assert of(1.0, math.inf) == math.inf
    assert of(-math.inf) == math.inf
    assert math.isnan(of(math.inf, math.nan, 2.0))
    assert math.isnan(of(-math.nan))
    assert of(3.0, 4.0) == 25.0
    assert of() == 0.0 and ExactSum().value() == 0.0
    largest = torch.full((1,), torch.finfo(torch.float32).max)
    big = ExactSum.of_squares(largest)
    for _ in range(12):
        big = big + big
    assert big.value() == 4096 * float(largest.double()) ** 2  # far from the double range
    with pytest.raises(TypeError, match="float32"):
        ExactSum.of_squares(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        ExactSum(torch.zeros(3))


def test_a_short_last_row_is_measured_as_a_padded_row():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    padded = torch.zeros(4096)
    padded[:3000] = x
    assert torch.equal(row_norms(x).tail, row_norms(padded).rows[1])
    assert torch.equal(tail_norm(x[2048:]), row_norms(padded).rows[1])


def _tier(kind: str, numels: list[int], store: SwapStore):
    """A gradient tier of `kind` over sub-groups of `numels`: NVMe with two buffers (the
    sub-groups spill as they are filled), the CPU device, or a split of device, host and
    NVMe."""
    accel = get_accelerator()
    if kind == "host":
        return HostGradTier(numels)
    if kind == "nvme":
        return NvmeGradTier(numels, store=store, aio=AIO, buffer_count=2, kind=next(_KINDS))
    if kind == "device":
        return DeviceGradTier(numels, accel)
    third = max(1, len(numels) // 3)
    rest = len(numels) - 2 * third
    parts = [(third, DeviceGradTier(numels[:third], accel))]
    parts.append((third, HostGradTier(numels[third : 2 * third])))
    nvme = NvmeGradTier(numels[2 * third :], store=store, aio=AIO, kind=next(_KINDS))
    parts.append((rest, nvme))
    return SplitGradTier(numels, parts)


def _rank_sum(params, world: int, rank: int, eight_bit: bool, sub: int, kind: str, store):
    """One rank's exact sum of squares over its shards, through a gradient tier of `kind`
    laid out as the optimizer lays out that rank's slots, filled from the last sub-group to
    the first as backward fills them."""
    align = shard_align(eight_bit)
    shards = []
    for p in params:
        s = shard_of(p.numel(), world, rank, align)
        shard = torch.zeros(s.numel)
        shard[: s.stop - s.start] = p[s.start : s.stop]
        shards.append(shard)
    layout = flat_layout([s.numel() for s in shards], sub)
    flat = torch.zeros(layout.total)
    for slot, values in enumerate(shards):
        flat[layout.offsets[slot] : layout.offsets[slot] + values.numel()] = values
    numels = layout.sub_group_numels
    tier = _tier(kind, numels, store)
    for g in reversed(range(len(numels))):
        start = layout.range(g)[0]
        tier.add(g, 0, flat[start : start + numels[g]])
    total = sum(tier.sums_of_squares(), ExactSum())
    tier.close()
    return total


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["host", "nvme", "device", "split"])
@pytest.mark.parametrize("eight_bit", [False, True])
def test_the_norm_of_sharded_gradients_is_one_ranks_bit_for_bit(
    tmp_path, eight_bit, kind, restore_threads
):
    """Parameters of awkward sizes, sharded over 2, 3 and 4 ranks (reduced as the
    all-reduce does: the bins added), each rank on 1 or 3 torch threads and on any gradient
    tier, give one rank's exact sum on one thread in host memory."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=gen) * 10.0 ** float(e) for n, e in
              ((70_001, -3), (5, 2), (2048, 0), (100_000, -1), (129, 1), (40_960, -6))]  # fmt: skip
    torch.set_num_threads(1)
    with SwapStore(str(tmp_path), run_id="t") as store:
        one = _rank_sum(params, 1, 0, eight_bit, 2048 * 20, "host", store)
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for world in (2, 3, 4):
                ranks = [
                    _rank_sum(params, world, r, eight_bit, 2048 * 7, kind, store)
                    for r in range(world)
                ]
                assert sum(ranks, ExactSum()) == one, (threads, world)
    # Exact over the rows, whose norms are within fp32 rounding of the true ones.
    want = sum(float(p.double().square().sum()) for p in params)
    assert abs(one.value() - want) < 1e-6 * want
