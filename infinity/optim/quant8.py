"""The 8-bit blockwise quantization of Adam's moments: the dynamic maps and their tables.

Owns the scheme's numbers, computed once: the two dynamic quantization maps of
bitsandbytes' blockwise 8-bit Adam (256 values each: signed for exp_avg, unsigned for
exp_avg_sq) and the code tables that find the nearest value with one lookup (the twin
and the native kernel read the same ones), with the same table as a search tree for the
AVX-512 kernel and as a coarse index for its VBMI level. It does not own any optimizer
state or the Adam step (`adam8.py`).

[Note: the 8-bit scheme] A moment tensor is cut into blocks of `BLOCK` elements (from the
start of each slot: slots start on multiples of it), and each block keeps one fp32 absmax
and one uint8 code per element. An element's value is `qmap[code] * absmax`. To quantize,
the block's fp32 values are multiplied by the fp32 reciprocal of its absmax (of
1.17549435e-38, the smallest normal float, when the absmax is smaller, so zeros stay zeros)
and each product y in [-1, 1] takes the code of the nearest map value, found by one table
lookup: |y|'s top 19 bits (its exponent and 10 mantissa bits) name a bucket of width 2^-10
of its value, and the bucket's code is the map value nearest its centre (the number of
midpoints below the centre). A value within 2^-10 relative of a midpoint may so take the
neighbour: the map's values are at least 0.7% apart, the buckets 0.1% wide. The signed
map holds 0, 1.0 and 127 magnitudes with both signs, but not -1.0: a negative y takes the
mirror of |y|'s code, capped at the largest magnitude below 1 (as bitsandbytes' map, where
-1.0 rounds to -0.99296875). The maps are bitsandbytes' `create_dynamic_map` values
(max_exponent_bits=7): decade i (0..6) holds 2**i (signed) or 2**(i+1) (unsigned) evenly
spaced means of [0.1, 1] x 10**(i-6), plus 0 and 1; computed in float64, rounded to fp32.
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
SHIFT = 13
"""|y|'s fp32 bits >> SHIFT is its bucket (sign 0, 8 exponent bits, 10 mantissa bits)."""
_BASE = (127 - 24) << (23 - SHIFT)
"""Bucket 0 of the code tables: values below 2**-24 (no midpoint lies that low)."""
_TOP = 127 << (23 - SHIFT)
"""The bucket of 1.0 (the last one: |y| <= 1, or a rounding above it)."""


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
    """One map's tables: what the twin and the kernel both read (the same numbers)."""

    qmap: torch.Tensor
    """[256] fp32: the value of each code."""
    codes: torch.Tensor
    """[_TOP - _BASE + 1 + 3] uint8: for bucket b of |y| (its bits >> SHIFT minus _BASE,
    clamped), the number of midpoints between non-negative map values below the bucket's
    centre (the code itself for the unsigned map; |y|'s side of it for the signed one). Three
    bytes of padding: the kernel reads 4 bytes at a byte offset."""
    tree: torch.Tensor
    """[256] int16: the code table's staircase as an implicit binary search tree, for the
    AVX-512 kernel's search in registers. Step k (1..255) is the first bucket whose code is
    >= k (0x7fff where none is); node i (1..255) at depth d = floor(log2 i) holds step
    (2 (i - 2^d) + 1) 2^(7 - d), so node i's children are 2i and 2i + 1 and a walk from the
    root ends at node 256 + the code."""
    index: torch.Tensor
    """[896] uint8: the code table as a coarse index, for the AVX-512 VBMI kernel (see
    [Note: quantizing by a coarse index]): 64 int16 region words (shift << 8 | offset), then
    the first code of each of up to 128 keys and `INDEX_STEPS` planes of 128 step
    positions."""


@functools.cache
def tables(signed: bool) -> QuantTables:
    """The tables of the signed (exp_avg) or unsigned (exp_avg_sq) map."""
    qmap = torch.tensor(dynamic_map(signed), dtype=torch.float32)
    half = qmap[qmap >= 0].double()  # 0 .. 1: all 256 unsigned, 129 signed
    mids = (half[:-1] + half[1:]) / 2
    edges = torch.arange(_BASE, _TOP + 2, dtype=torch.int64) << SHIFT
    lo = edges.to(torch.int32).view(torch.float32).double()
    centre = (lo[:-1] + lo[1:]) / 2
    centre[0] = 0.0  # bucket 0 takes everything below 2**-24 too
    codes = torch.searchsorted(mids, centre, side="left")
    padded = torch.cat([codes, torch.zeros(3, dtype=torch.int64)]).to(torch.uint8)
    return QuantTables(qmap, padded, _search_tree(codes), _coarse_index(codes, signed))


def _search_tree(codes: torch.Tensor) -> torch.Tensor:
    """QuantTables.tree of a non-decreasing code table (int64, one entry per bucket)."""
    assert bool((codes[1:] >= codes[:-1]).all()), "code table must be non-decreasing"
    steps = torch.searchsorted(codes, torch.arange(256), side="left")  # [k]: first code >= k
    steps[steps == codes.numel()] = 0x7FFF
    node = torch.arange(1, 256)
    depth = torch.floor(torch.log2(node.double())).long()
    tree = torch.zeros(256, dtype=torch.int16)
    tree[1:] = steps[(2 * (node - (1 << depth)) + 1) << (7 - depth)].to(torch.int16)
    return tree


INDEX_STEPS = 5
"""Step planes of the coarse index: a key's interval holds at most 2 (signed) or 5 steps."""
_INDEX_KEYS = 128  # one byte permute reads 128 entries
_NO_STEP = 255  # a step position no byte exceeds


def _half_codes(codes: torch.Tensor) -> torch.Tensor:
    """The code of every 15-bit h (the fp16 bits of |y| * 2**10, rounded toward zero): h
    is bucket + 1024 from 2**-24 up, lower h is bucket 0, higher the top bucket."""
    bucket = (torch.arange(1 << 15) - (1 << 10)).clamp(0, codes.numel() - 1)
    return codes[bucket]


def _coarse_index(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """QuantTables.index of a non-decreasing code table (int64, one entry per bucket)."""
    full = _half_codes(codes)
    assert bool((full[1:] - full[:-1] <= 1).all()), "a step must raise the code by one"
    limit = 2 if signed else INDEX_STEPS
    shifts, offsets = torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
    # A flat region shifts all of h out, its sign bit too (a shift of 16 leaves 0); the
    # others shift by at most 8, so h's sign bit lands on bit 7 of the key or above it.
    first = torch.zeros(_INDEX_KEYS, dtype=torch.int64)
    steps = torch.full((INDEX_STEPS, _INDEX_KEYS), _NO_STEP, dtype=torch.int64)
    flat_keys: dict[int, int] = {}
    keys = 0
    for region in range(64):
        lo = region << 9
        seg = full[lo : lo + 512]
        if seg[0] == seg[-1]:  # one code: a key shared by every such region (shift all out)
            key = flat_keys.setdefault(int(seg[0]), keys)
            keys += key == keys
            shifts[region], offsets[region], first[key] = 16, key, seg[0]
            continue
        shift = next(s for s in range(8, -1, -1) if _fits(seg, 1 << s, limit))
        shifts[region], offsets[region] = shift, (keys - (lo >> shift)) & 0xFF
        for start in range(0, 512, 1 << shift):
            part = seg[start : start + (1 << shift)]
            at = (part[1:] != part[:-1]).nonzero().flatten() + 1
            first[keys] = part[0]
            steps[: at.numel(), keys] = ((lo + start + at) & 0xFF) - 1
            keys += 1
    assert keys <= _INDEX_KEYS, f"coarse index needs {keys} keys"
    words = (shifts << 8 | offsets).to(torch.int16).view(torch.uint8)
    return torch.cat([words, first.to(torch.uint8), steps.flatten().to(torch.uint8)])


def _fits(seg: torch.Tensor, width: int, limit: int) -> bool:
    """Whether every `width`-aligned interval of `seg` holds at most `limit` steps."""
    parts = seg.view(-1, width)
    return bool((parts[:, -1] - parts[:, 0] <= limit).all())


def index_codes(h: torch.Tensor, signed: bool) -> torch.Tensor:
    """The code side the coarse index gives each 16-bit h (int64, its sign bit ignored), as
    the kernel reads it: key = low 7 bits of (h >> shift) + offset."""
    index = tables(signed).index
    words = index[:128].view(torch.int16).long()
    word = words[(h >> 9) & 63]
    shift = word >> 8
    key = (torch.where(shift < 16, h >> shift.clamp_max(15), 0) + word) & 0x7F
    first = index[128:256].long()
    steps = index[256:].view(INDEX_STEPS, _INDEX_KEYS).long()
    return first[key] + ((h & 0xFF)[None, :] > steps[:, key]).sum(dim=0)


def bucket_codes(yabs: torch.Tensor, signed: bool) -> torch.Tensor:
    """The code table's entry for each |y| (fp32, >= 0): what the kernel looks up."""
    bucket = ((yabs.view(torch.int32) >> SHIFT) - _BASE).clamp(0, _TOP - _BASE)
    return tables(signed).codes[bucket.long()].long()


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [n], absmax fp32 [ceil(n / BLOCK)]) of flat fp32 `x`: the reference."""
    n = x.numel()
    blocks = torch.zeros(block_count(n) * BLOCK, dtype=torch.float32)
    blocks[:n] = x
    blocks = blocks.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    inverse = 1.0 / absmax.clamp_min(TINY)  # one division per block, as the kernel
    y = (blocks * inverse[:, None]).reshape(-1)[:n]
    count = bucket_codes(y.abs().contiguous(), signed)
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
