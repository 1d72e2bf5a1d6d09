"""Gradients reduce-scattered in buckets across 2 gloo ranks into each rank's shard slots."""

from __future__ import annotations

import math

import pytest
from _dist import rank_results, run_ranks

from infinity.zero.grad_reduce import pooled_bucket_nbytes


@pytest.mark.parametrize(
    "bucket,overlap,contiguous,half",
    [(16, 1, 1, 0), (16, 0, 1, 0), (16, 1, 0, 0), (10_000, 1, 1, 0), (16, 1, 0, 1)],
    ids=["overlap-contiguous", "sync-contiguous", "overlap-kept", "one-bucket", "bf16-in-fp32"],
)
def test_buckets_reduce_scatter_the_mean_into_each_shard(bucket, overlap, contiguous, half):
    """bf16-in-fp32: bf16 gradients cast into fp32 buckets (communication_data_type "fp32"),
    the buckets laid out when issued: the slots hold the fp32 sums of the bf16 values."""
    args = ["reduce", str(bucket), str(overlap), str(contiguous), str(half)]
    res = rank_results(run_ranks("_grad_reduce_child.py", args))
    for out in res:
        assert out["equal"], "a rank's slots differ from its shard of the mean gradient"
        s = out["stats"]
        assert s["comm_reduce_scatter_calls"] == out["buckets"]
        # Sizes 5,7,1,300,64,3 over 2 ranks: shards 3,4,1,150,32,2 (384 padded elements per
        # backward); the buckets carry exactly those, twice, in fp32 (the bf16 ones too).
        assert s["comm_reduce_scatter_bytes"] == 2 * 2 * (3 + 4 + 1 + 150 + 32 + 2) * 4
        shards, total = out["shards"], sum(out["shards"])
        pooled = pooled_bucket_nbytes(
            shards, 2, bucket, total, overlap=bool(overlap), contiguous=bool(contiguous), itemsize=4
        )
        assert out["pooled"] == pooled  # what the estimate counts
        assert (pooled > 0) == bool(contiguous)
    if bucket == 16:
        # Rows of 8 elements, filled in hook order (the reverse of creation): shard 2 (the
        # 32 after it does not fit), 32 and 150 alone (larger than a row), then 1+4+3 = 8
        # fills a row exactly: 4 buckets per backward.
        assert res[0]["buckets"] == 8
    else:
        assert res[0]["buckets"] == 2  # one per backward


def test_optimizer_norm_and_overflow_are_global():
    res = rank_results(run_ranks("_grad_reduce_child.py", ["norm"]))
    for out in res:
        assert not out["overflow"]
        assert math.isclose(out["norm"], out["want"], rel_tol=1e-6)
    res = rank_results(run_ranks("_grad_reduce_child.py", ["norm", "inf-on-rank-1"]))
    assert [out["overflow"] for out in res] == [True, True]
