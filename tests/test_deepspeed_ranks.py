"""`infinity.deepspeed` on two gloo ranks: ZeRO stages 0-3 give equal losses, and
`training_data` is split across the ranks; GatheredParameters(modifier_rank=0) sends rank
0's changes to every rank, before initialize and after it (there: to the weights and
the fp32 masters of every rank's shard, as torch AdamW continues)."""

from __future__ import annotations

import pytest
from _dist import rank_results, run_ranks


def test_stages_give_equal_losses_on_two_ranks_and_the_data_is_split():
    results = rank_results(run_ranks("_deepspeed_ranks_child.py", [], timeout_s=240))
    for r in results:
        assert r["gathered"] == [9.0]  # 4 * 2.0 + 1.0: rank 0's weights, on both ranks
        after = r["after_initialize"]  # read, then rank 0's write, after initialize
        assert after["read_ok"], r
        assert after["losses"] == pytest.approx(after["ref_losses"], abs=1e-5), r
        assert len(r["stage3"]) == 4
        for stage in (0, 1, 2):
            assert r[f"stage{stage}"] == r["stage3"], (stage, r)
    assert results[0]["stage3"] == results[1]["stage3"]  # the all-reduced losses
    a, b = (set(r["seen"]) for r in results)
    assert len(a) == len(b) == 8 and not a & b  # each rank its own half
