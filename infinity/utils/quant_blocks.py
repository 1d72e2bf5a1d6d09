"""The block of the 8-bit optimizer state: how many elements share one fp32 absmax.

One number, shared by the quantization (`infinity.optim.quant8`) and the state tiers that
lay the absmax out beside the codes (`infinity.swap.state_format`), which may not import
each other.
"""

from __future__ import annotations

BLOCK = 256
"""Elements per quantization block (one fp32 absmax each); slots start on multiples of it."""


def block_count(numel: int) -> int:
    """Absmax entries of `numel` elements."""
    return -(-numel // BLOCK)
