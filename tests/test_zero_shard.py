"""The partitioning rule: shard sizes, spans and padding, including tiny parameters."""

from __future__ import annotations

import pytest
import torch

from infinity.comm import SingleProcess
from infinity.swap.grad_plan import NORM_ROW_NUMEL
from infinity.utils.quant_blocks import BLOCK
from infinity.zero.shard import check_same_weights, fingerprint, shard_align, shard_of, take_shard
from infinity.zero.sub_groups import SLOT_ALIGN


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


@pytest.mark.parametrize("numel", [0, 1, 255, 700, 4096, 10_001])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("eight_bit", [False, True])
def test_shards_start_on_a_norm_row_and_a_block_of_the_whole_parameter(numel, world, eight_bit):
    align = shard_align(eight_bit=eight_bit)
    assert align == NORM_ROW_NUMEL == 2048 and align % BLOCK == 0 and SLOT_ALIGN % align == 0
    shards = [shard_of(numel, world, r, align) for r in range(world)]
    if world == 1:  # one rank: the parameter itself
        assert shards[0] == shard_of(numel, 1, 0)
    else:
        assert shards[0].numel % align == 0 and shards[0].numel >= -(-numel // world)
        assert shards[0].numel < -(-numel // world) + align
    assert [s.start for s in shards] == [min(r * shards[0].numel, numel) for r in range(world)]
    assert sum(s.stop - s.start for s in shards) == numel
