"""HalfGradTier: gradients kept in 16 bits read as the fp32 sums HostGradTier holds (see
[Note: 16-bit gradient sums] in infinity/swap/grad_half.py)."""

from __future__ import annotations

import pytest
import torch

from infinity.swap.grad_half import HalfGradTier
from infinity.swap.grad_tier import HostGradTier

NUMELS = [5000, 4096, 37]


def _both(dtype):
    return HostGradTier(NUMELS), HalfGradTier(NUMELS, dtype)


def _same(a, b) -> None:
    assert a.sums_of_squares() == b.sums_of_squares()
    for g in range(len(NUMELS)):
        x, y = a.take(g).float(), b.take(g).float()
        assert torch.equal(x, y), g  # equal values (a -0 of the 16-bit copy equals +0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_gradient_per_range_reads_as_its_fp32_sum_with_no_fp32_buffer(dtype):
    host, half = _both(dtype)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # two windows: the second reuses the bytes without zeroing them
        pieces = [(0, 0, 3000), (0, 3000, 2000), (1, 0, 4096), (2, 5, 30)]
        for index, start, n in pieces:
            src = torch.randn(n, generator=g).to(dtype)
            src[::7] = -0.0
            host.add(index, start, src)
            half.add(index, start, src)
        _same(host, half)
        for index in range(len(NUMELS)):
            host.release(index)
            half.release(index)
    stats = half.memory_stats()
    assert stats["grad_host_bytes"] == 2 * sum(NUMELS)  # 16 bits, no fp32 sum anywhere


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_range_no_gradient_reached_reads_as_zeros(dtype):
    host, half = _both(dtype)
    ones = torch.ones(3000, dtype=dtype)
    for t in (host, half):
        t.add(0, 0, ones)
        t.release(0)
        t.add(0, 2000, ones[:1000])  # the window after: [0, 2000) was not written
    _same(host, half)


def test_a_second_gradient_or_an_fp32_one_makes_an_fp32_sum():
    host, half = _both(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(4096, generator=g).bfloat16()
    b = torch.randn(1000, generator=g).bfloat16()
    c = torch.randn(37, generator=g)  # a reduce-scatter's fp32 mean
    for t in (host, half):
        t.add(1, 0, a)
        t.add(1, 100, b)  # overlaps the first: summed in fp32
        t.add(2, 0, c)
    assert half.take(1).dtype == half.take(2).dtype == torch.float32
    _same(host, half)
    half.release(1)
    assert half.take(1).dtype == torch.bfloat16 and not half.take(1).any()


def test_only_16_bit_dtypes():
    with pytest.raises(ValueError, match="fp16 or bf16"):
        HalfGradTier(NUMELS, torch.float32)
