"""An 8-bit checkpoint reshards across world sizes exactly: saved by one rank, loaded and
saved again by two gloo ranks, loaded by one rank, training continues bit for bit as the
uninterrupted one-rank run (see [Note: 8-bit state in checkpoints])."""

from __future__ import annotations

import pytest
from _dist import rank_results, run_ranks
from _dist_reshard_child import run

from infinity import comm


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_one_rank_to_two_and_back_resumes_as_the_uninterrupted_run(tmp_path, tier):
    swap = tmp_path / "swap"
    swap.mkdir()
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    whole = run(comm.SingleProcess(), "-", "-", 4, tier, str(swap))
    first = run(comm.SingleProcess(), "-", one, 2, tier, str(swap))
    assert first["losses"] == whole["losses"][:2]
    args = [one, two, "0", tier, str(swap)]  # 1 -> 2 ranks, saved again by two
    ranks = rank_results(run_ranks("_dist_reshard_child.py", args, timeout_s=180))
    assert ranks[0]["weight_sums"] == ranks[1]["weight_sums"] == first["weight_sums"]
    rest = run(comm.SingleProcess(), two, "-", 2, tier, str(swap))  # 2 -> 1 rank
    assert rest["losses"] == whole["losses"][2:]
    assert rest["weight_sums"] == whole["weight_sums"]
