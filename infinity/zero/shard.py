"""The partitioning rule across ranks: which elements of a parameter each rank keeps.

World size W, rank r, a parameter of N elements: the shard size is S = ceil(N / W), and
rank r keeps elements [r*S, (r+1)*S) of the parameter flattened and zero-padded to W*S. Its
unpadded span is (min(r*S, N), min((r+1)*S, N)), empty for a tiny parameter on a high rank.
With W == 1, S == N and the span is the whole parameter. With several ranks S is rounded
up to a multiple of `align` (`shard_align`: 2048, the global norm's row, which the 8-bit
state's quantization block of 256 divides), so every rank's shard starts on a row and on a
block of the whole parameter: row k holds elements [2048k, 2048k + 2048) at any world size,
and so do the 8-bit blocks. The rows' norms, and so the global norm and the clip, are the
same bits on one rank and on several (see [Note: the norm's order] in
infinity/swap/grad_tier.py), and so are the blocks' absmax (the runs are bitwise one
rank's, and the state reshards). The padding is never trained: its gradient is zero (so its
Adam update is too, without weight decay) and all-gathers drop it.
Each rank keeps its shard of the weights it built itself, so every rank must build the same
weights: `check_same_weights` compares a fingerprint of them across ranks before sharding.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from infinity.comm import Comm
from infinity.swap.grad_plan import NORM_ROW_NUMEL
from infinity.utils.quant_blocks import BLOCK

_SAMPLES = 256
"""Elements of each parameter that its fingerprint hashes (evenly spaced)."""


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


def shard_align(eight_bit: bool) -> int:
    """The shards' alignment in elements with several ranks: whole rows of the global norm,
    and whole blocks of the 8-bit state (see above)."""
    return math.lcm(NORM_ROW_NUMEL, BLOCK if eight_bit else 1)


def shard_of(numel: int, world_size: int, rank: int, align: int = 1) -> Shard:
    """Rank `rank`'s shard of a parameter of `numel` elements over `world_size` ranks, its
    size a multiple of `align` when world_size > 1."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of world_size {world_size}")
    s = -(-numel // world_size)
    if world_size > 1:
        s = -(-s // align) * align
    return Shard(s, min(rank * s, numel), min((rank + 1) * s, numel))


def take_shard(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """A new flat tensor of `shard.numel` elements: the shard's span of `full` (flat, N
    elements), then zeros."""
    out = torch.zeros(shard.numel, dtype=full.dtype, device=full.device)
    n = shard.stop - shard.start
    if n:
        out[:n].copy_(full.reshape(-1)[shard.start : shard.stop])
    return out


def fingerprint(param: torch.Tensor) -> str:
    """A hash of `_SAMPLES` evenly spaced elements of `param` (cheap at any size)."""
    flat = param.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // _SAMPLES)].to("cpu", torch.float32)
    return hashlib.blake2b(sample.numpy().tobytes(), digest_size=8).hexdigest()


def check_same_weights(named: Iterable[tuple[str, nn.Parameter]], comm: Comm) -> None:
    """Raise ValueError naming the first parameter whose initial weights differ between
    ranks (one object all-gather; parameters on the meta device are left to later checks)."""
    mine = [(name, fingerprint(p)) for name, p in named if not p.is_meta]
    every = comm.all_gather_object(mine)
    for rank, theirs in enumerate(every):
        for (name, a), (_, b) in zip(every[0], theirs, strict=False):
            if a != b:
                raise ValueError(
                    f"rank {rank} built different initial weights than rank 0 (first: "
                    f"{name!r}): every rank keeps its shard of the model it built, so all "
                    "must build the same one; seed every rank alike (torch.manual_seed(seed) "
                    "before building the model) or load the same pretrained weights"
                )
        if len(theirs) != len(every[0]):
            raise ValueError(
                f"rank {rank} built a model with {len(theirs)} parameters, rank 0 one with "
                f"{len(every[0])}: every rank must build the same model"
            )
