"""The 8-bit blockwise quantization of Adam's moments: the dynamic maps and their tables.

Owns the scheme's numbers, computed once: the two dynamic quantization maps of
bitsandbytes' blockwise 8-bit Adam (256 values each: signed for exp_avg, unsigned for
exp_avg_sq), their midpoints, and the bucket tables the native kernel uses to find the
nearest value without a search. It does not own any optimizer state or the Adam step
(`adam8.py`).

[Note: the 8-bit scheme] A moment tensor is cut into blocks of `BLOCK` elements (from the
start of each slot: slots start on multiples of it), and each block keeps one fp32 absmax
and one uint8 code per element. An element's value is `qmap[code] * absmax`. To quantize,
the block's fp32 values are multiplied by the fp32 reciprocal of its absmax (of
1.17549435e-38, the smallest normal float, when the absmax is smaller, so zeros stay zeros)
and each product y in [-1, 1] takes the code of the nearest map value: code = the number
of midpoints strictly below |y|, so a value exactly on a midpoint goes to the value nearer
zero. The signed map holds 0, 1.0 and 127
magnitudes with both signs, but not -1.0: a negative y takes the mirror of |y|'s code,
capped at the largest magnitude below 1 (as bitsandbytes' map, where -1.0 rounds to
-0.99296875). The maps are bitsandbytes' `create_dynamic_map` values (max_exponent_bits=7):
decade i (0..6) holds 2**i (signed) or 2**(i+1) (unsigned) evenly spaced means of
[0.1, 1] x 10**(i-6), plus 0 and 1; computed here in float64 and rounded to fp32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from infinity.utils.quant_blocks import BLOCK, block_count

ZERO_CODE_SIGNED = 127
"""The signed map's code of 0 (a zeroed exp_avg)."""
TINY = 1.17549435e-38
"""The divisor of an all-zero block (the smallest normal fp32)."""
_BASE = (127 - 24) << 7
"""Bucket 0 of the bucket tables: values below 2**-24 (no midpoint lies that low)."""
_TOP = 127 << 7
"""The bucket of 1.0 (the last one: |y| <= 1)."""


def dynamic_map(signed: bool) -> list[float]:
    """The 256 values of the dynamic map, ascending, in float64 (see [Note: the 8-bit scheme])."""
    values = [0.0, 1.0]
    for i in range(7):
        count = 2**i if signed else 2 ** (i + 1)
        scale = 10.0 ** (i - 6)
        for k in range(count):
            mean = 0.1 + (k + 0.5) * 0.9 / count
            values.append(scale * mean)
            if signed:
                values.append(-scale * mean)
    assert len(values) == 256, len(values)
    return sorted(values)


class QuantTables(NamedTuple):
    """One map's tables: what the twin and the kernel both read (the same fp32 numbers)."""

    qmap: torch.Tensor
    """[256] fp32: the value of each code."""
    mids: torch.Tensor
    """[N+1] fp32: the midpoints between consecutive non-negative values (N = 255 unsigned,
    128 signed), then +inf."""
    buckets: torch.Tensor
    """[_TOP - _BASE + 1] int32: for bucket b (|y|'s top 16 bits minus _BASE, clamped), the
    number of midpoints below the bucket's smallest value; at most one more lies inside it."""


@functools.cache
def tables(signed: bool) -> QuantTables:
    """The tables of the signed (exp_avg) or unsigned (exp_avg_sq) map."""
    qmap = torch.tensor(dynamic_map(signed), dtype=torch.float32)
    half = qmap[qmap >= 0].double()  # 0 .. 1: all 256 unsigned, 129 signed
    mids = ((half[:-1] + half[1:]) / 2).float()
    bucket_lo = (torch.arange(_BASE, _TOP + 1, dtype=torch.int32) << 16).view(torch.float32)
    bucket_lo[0] = 0.0  # bucket 0 takes everything below 2**-23 too
    below = torch.searchsorted(mids, bucket_lo, side="left").to(torch.int32)
    within = torch.diff(torch.cat([below, torch.tensor([len(mids)], dtype=torch.int32)]))
    assert int(within.max()) <= 1, "a bucket holds two midpoints: use finer buckets"
    inf = torch.tensor([float("inf")], dtype=torch.float32)
    return QuantTables(qmap, torch.cat([mids, inf]).contiguous(), below.contiguous())


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [n], absmax fp32 [ceil(n / BLOCK)]) of flat fp32 `x`: the reference."""
    t = tables(signed)
    n = x.numel()
    blocks = torch.zeros(block_count(n) * BLOCK, dtype=torch.float32)
    blocks[:n] = x
    blocks = blocks.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    inverse = 1.0 / absmax.clamp_min(TINY)  # one division per block, as the kernel
    y = (blocks * inverse[:, None]).reshape(-1)[:n]
    count = torch.searchsorted(t.mids[:-1], y.abs().contiguous(), side="left")
    if signed:
        codes = torch.where(
            y < 0, ZERO_CODE_SIGNED - count.clamp_max(127), ZERO_CODE_SIGNED + count
        )
    else:
        codes = count
    return codes.to(torch.uint8), absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """Flat fp32 values of `codes` [n] with their blocks' `absmax`: qmap[code] * absmax."""
    n = codes.numel()
    scale = absmax.repeat_interleave(BLOCK)[:n]
    return tables(signed).qmap[codes.long()] * scale
