"""Trainable weights kept gathered across the micro batches of a step (see [Note: weights
kept across micro batches] in infinity/zero/live_plan.py): the losses, gradient norms,
weights and optimizer state are bitwise those of a run that gathers them at every micro
batch, and each kept parameter is fetched once a step instead."""

from __future__ import annotations

import pytest
from _dist import rank_results, run_ranks
from _keep import keep_config, train_counting
from _overlap import STEPS, same_bits


def _pair(tmp_path, keep: int, **case) -> tuple[dict, dict]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = train_counting(keep_config(**case, nvme_dir=str(tmp_path / "a"), keep=0))
    kept = train_counting(keep_config(**case, nvme_dir=str(tmp_path / "b"), keep=keep))
    return plain, kept


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kept_weights_are_bitwise_and_fetched_once_a_step(tmp_path, dtype, accum, tier):
    plain, kept = _pair(tmp_path, 10**9, dtype=dtype, accum=accum, tier=tier)
    same_bits(kept, plain)
    # Every trainable parameter is kept: fetched once per optimizer step, where the plain run
    # fetches each at every micro batch (at least).
    assert kept["fetches"] and set(kept["fetches"]) == set(plain["fetches"])
    assert all(n == STEPS for n in kept["fetches"].values()), kept["fetches"]
    assert all(n >= STEPS * accum for n in plain["fetches"].values())
    assert kept["kept_numel"] > 0 and plain["kept_numel"] == 0


def test_a_budget_keeps_the_first_weights_and_gathers_the_rest(tmp_path):
    plain, kept = _pair(tmp_path, 3000, dtype="bf16", accum=4, tier="nvme")
    same_bits(kept, plain)
    once = [n for n, k in kept["fetches"].items() if k == STEPS]
    again = [n for n, k in kept["fetches"].items() if k > STEPS]
    assert once and again  # some kept, some not
    assert 0 < kept["kept_numel"] <= 3000
    total = sum(kept["fetches"].values())
    assert total < sum(plain["fetches"].values())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_kept_weights_under_the_overlapped_step_are_bitwise(tmp_path, dtype):
    """The overlapped step computes new weights while the last micro batch's backward runs
    (into buffers of their own, published by the step after the kept copies are released)."""
    case = dict(dtype=dtype, accum=4, tier="cpu", overlap=True)
    plain, kept = _pair(tmp_path, 10**9, **case)
    same_bits(kept, plain)
    assert min(a for a, _ in kept["ahead"]) > 0


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_two_ranks_kept_weights_are_bitwise(tmp_path, tier):
    args = ["bf16", "4", tier, str(tmp_path)]
    results = rank_results(run_ranks("_keep_child.py", args, timeout_s=300))
    for runs in results:
        same_bits(runs["kept"], runs["plain"])
        assert all(n == STEPS for n in runs["kept"]["fetches"].values())
    assert results[0]["kept"]["losses"] != results[1]["kept"]["losses"]  # each its own batch
