"""An exact, order-free sum of squares of fp32 values: `ExactSum`.

Owns the representation and its arithmetic only (what is summed is the caller's: the
gradient tiers' row norms, see [Note: the norm's order] in infinity/swap/grad_tier.py).
The square of an fp32 value is exact in fp64 and has at most 48 significant bits, so it is
m * 2^(e - 1070) with m a 48-bit integer and e the double's exponent field, both read from
its bits. The m are added in int64, one bin per e (2^15 of them fit), then carried into fp64
bins as two halves, each an integer below 2^53: fp64 adds those exactly in any order, by
sub-groups or by an all-reduce over the ranks (`bins` is the tensor to reduce). `value`
rounds the exact total once, so a sum is the same bits however its terms were grouped.
"""

from __future__ import annotations

import math

import torch

_FRACTION_BITS = 52
_ZERO_BITS = 5
"""Low fraction bits that are zero in the square of an fp32 value (24-bit significand:
a 47- or 48-bit product in a 53-bit one); dropped, so m is below 2^48."""
_CHUNK = 1 << 15
"""Terms per int64 pass: 2^15 values of m (< 2^48) stay below 2^63. Small enough also for
the allocator to reuse the temporaries (a fresh large one is mapped and zeroed page by page,
ten times the arithmetic)."""
_LOW_BITS = 26
"""A pass's int64 bin s (< 2^63) is carried as s >> 26 (< 2^37) and s & (2^26 - 1): the fp64
bins stay exact integers for 2^16 full passes, 2^31 terms (4.4e12 elements in rows of 2048)."""
_BINS = 2048
"""One per value of a double's exponent field. Field 0 holds only zeros (the square of the
smallest fp32 is a normal double): it is not read. The last one (all ones) holds inf/NaN."""
_NAN = 2 * _BINS
_SIZE = 2 * _BINS + 1
"""bins: [high halves by exponent field | low halves by exponent field | NaN count]."""


class ExactSum:
    """The exact sum of the squares of fp32 values (inf and NaN propagate): add two with
    `+`, reduce `bins` over ranks with a sum, read it with `value()` or `float()`."""

    __slots__ = ("bins",)

    def __init__(self, bins: torch.Tensor | None = None) -> None:
        if bins is None:
            bins = torch.zeros(_SIZE, dtype=torch.float64)
        if bins.shape != (_SIZE,) or bins.dtype != torch.float64:
            raise ValueError(
                f"ExactSum: bins must be [{_SIZE}] float64, got {tuple(bins.shape)} {bins.dtype}"
            )
        self.bins = bins
        """[2 * 2048 + 1] float64 integers (see above): sum it over ranks to add their sums."""

    @classmethod
    def of_squares(cls, values: torch.Tensor) -> ExactSum:
        """The exact sum of the squares of `values` (float32, any shape)."""
        if values.dtype != torch.float32:
            raise TypeError(f"ExactSum.of_squares: values must be float32, got {values.dtype}")
        out = cls()
        flat = values.reshape(-1)
        for lo in range(0, flat.numel(), _CHUNK):
            out._add(flat[lo : lo + _CHUNK].double().square())
        return out

    def _add(self, squares: torch.Tensor) -> None:
        """Add at most `_CHUNK` squares of fp32 values (float64)."""
        bits = squares.view(torch.int64)  # sign | exponent field | fraction
        field = (bits >> _FRACTION_BITS) & (_BINS - 1)
        m = ((bits & ((1 << _FRACTION_BITS) - 1)) | (1 << _FRACTION_BITS)) >> _ZERO_BITS
        s = torch.zeros(_BINS, dtype=torch.int64).index_add_(0, field, m)  # order-free
        s[0] = 0  # zeros (their m is garbage): the bins do not depend on how many there are
        self.bins[:_BINS] += (s >> _LOW_BITS).double()
        self.bins[_BINS : 2 * _BINS] += (s & ((1 << _LOW_BITS) - 1)).double()
        if s[_BINS - 1] > 0:  # inf or NaN: rare
            self.bins[_NAN] += float(torch.isnan(squares).sum())

    def __add__(self, other: ExactSum) -> ExactSum:
        return ExactSum(self.bins + other.bins)

    def __iadd__(self, other: ExactSum) -> ExactSum:
        self.bins += other.bins
        return self

    def __eq__(self, other: object) -> bool:
        """The same exact total (the bins of equal sums may differ in how the halves were
        carried)."""
        return isinstance(other, ExactSum) and self._exact() == other._exact()

    __hash__ = None  # mutable (`+=`)

    def _exact(self) -> int | float:
        """The total in units of 2^-1074 (the smallest subnormal double), or NaN/inf."""
        if self.bins[_NAN] > 0:
            return math.nan
        if self.bins[_BINS - 1] > 0 or self.bins[2 * _BINS - 1] > 0:
            return math.inf
        total = 0
        (used,) = torch.nonzero(self.bins[: 2 * _BINS], as_tuple=True)
        for field in sorted({int(i) % _BINS for i in used} - {0}):
            high, low = int(self.bins[field]), int(self.bins[_BINS + field])
            # m * 2^(field - 1070) in units of 2^-1074: m << (field + 4).
            total += ((high << _LOW_BITS) + low) << (field + _ZERO_BITS - 1)
        return total

    def value(self) -> float:
        """The exact total rounded to the nearest double (NaN if a term was NaN, else inf
        if one was inf). It stays finite: a square of an fp32 value is below 2^256, the
        largest double 2^1024."""
        total = self._exact()
        if isinstance(total, float):
            return total
        return total / (1 << 1074)  # int / int: correctly rounded

    __float__ = value

    def __repr__(self) -> str:
        return f"ExactSum({self.value()!r})"
