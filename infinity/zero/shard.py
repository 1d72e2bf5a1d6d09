"""The partitioning rule across ranks: which elements of a parameter each rank keeps.

World size W, rank r, a parameter of N elements: the shard size is S = ceil(N / W), and
rank r keeps elements [r*S, (r+1)*S) of the parameter flattened and zero-padded to W*S. Its
unpadded span is (min(r*S, N), min((r+1)*S, N)), empty for a tiny parameter on a high rank.
With W == 1, S == N and the span is the whole parameter. The padding is never trained: its
gradient is zero (so its Adam update is too, without weight decay) and all-gathers drop it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Shard(NamedTuple):
    """One rank's piece of one parameter."""

    numel: int
    """S: elements every rank keeps, padding included."""
    start: int
    """First element of the parameter in this rank's shard (clamped to N)."""
    stop: int
    """One past the last real element (clamped to N): stop - start <= numel."""

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.stop


def shard_of(numel: int, world_size: int, rank: int) -> Shard:
    """Rank `rank`'s shard of a parameter of `numel` elements over `world_size` ranks."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of world_size {world_size}")
    s = -(-numel // world_size)
    return Shard(s, min(rank * s, numel), min((rank + 1) * s, numel))


def take_shard(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """A new flat tensor of `shard.numel` elements: the shard's span of `full` (flat, N
    elements), then zeros."""
    out = torch.zeros(shard.numel, dtype=full.dtype, device=full.device)
    n = shard.stop - shard.start
    if n:
        out[:n].copy_(full.reshape(-1)[shard.start : shard.stop])
    return out
