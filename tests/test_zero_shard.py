"""The partitioning rule: shard sizes, spans and padding, including tiny parameters."""

from __future__ import annotations

import pytest
import torch

from infinity.comm import SingleProcess
from infinity.zero.shard import check_same_weights, fingerprint, shard_of, take_shard


@pytest.mark.parametrize(
    "numel,world,want",
    [
        (10, 1, [(10, 0, 10)]),
        (10, 2, [(5, 0, 5), (5, 5, 10)]),
        (10, 3, [(4, 0, 4), (4, 4, 8), (4, 8, 10)]),
        (1, 4, [(1, 0, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1)]),  # empty spans on high ranks
        (0, 2, [(0, 0, 0), (0, 0, 0)]),
    ],
)
def test_shards_cover_the_parameter_once(numel, world, want):
    shards = [shard_of(numel, world, r) for r in range(world)]
    assert [tuple(s) for s in shards] == want
    full = torch.arange(float(numel))
    padded = torch.cat([take_shard(full, s) for s in shards])
    assert padded.numel() == world * shards[0].numel
    assert torch.equal(padded[:numel], full) and not padded[numel:].any()


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank 2 is not a rank of world_size 2"):
        shard_of(5, 2, 2)


def test_fingerprint_sees_a_changed_element_and_same_weights_pass():
    w = torch.randn(10_000)
    assert fingerprint(w) == fingerprint(w.clone())
    w2 = w.clone()
    w2[0] += 1
    assert fingerprint(w2) != fingerprint(w)
    check_same_weights([("w", torch.nn.Parameter(w))], SingleProcess())  # one rank: agrees
