"""The overlapped optimizer step (see [Note: the overlapped step] in infinity/zero/overlap.py):
bitwise the serial step's results in every case, and really stepping sub-groups early."""

from __future__ import annotations

import pytest
from _dist import rank_results, run_ranks
from _overlap import overlap_config, same_bits, train


def _pair(tmp_path, **case) -> tuple[dict, dict]:
    serial = train(overlap_config(**case, nvme_dir=str(tmp_path / "a"), overlap=False))
    overlapped = train(overlap_config(**case, nvme_dir=str(tmp_path / "b"), overlap=True))
    return serial, overlapped


@pytest.fixture(autouse=True)
def _dirs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("clip", ["off", "loose", "biting"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_overlapped_step_is_bitwise_the_serial_one(tmp_path, dtype, clip, accum, tier):
    serial, overlapped = _pair(tmp_path, dtype=dtype, clip=clip, accum=accum, tier=tier)
    same_bits(overlapped, serial)
    assert all(a == [0, 0] for a in serial["ahead"])  # switched off: nothing early
    stepped = [a for a, _ in overlapped["ahead"]]
    assert min(stepped) > 0, overlapped["ahead"]  # every step began during backward
    pairs = zip(overlapped["ahead"], serial["skipped"], strict=True)
    confirmed = [c for (_, c), skip in pairs if not skip]
    if clip == "biting":
        assert max(confirmed) == 0  # every early step redone with the real coefficient
    elif confirmed:
        assert min(confirmed) > 0  # kept as computed
    if dtype == "fp16":
        assert any(serial["skipped"]) and not all(serial["skipped"])
        assert len(set(serial["scales"])) > 1  # the loss scale moved


@pytest.mark.parametrize(
    "dtype, clip, accum, tier",
    [("fp32", "loose", 4, "cpu"), ("bf16", "biting", 1, "nvme"), ("fp16", "off", 1, "cpu")],
)
def test_two_ranks_overlapped_are_bitwise_serial(tmp_path, dtype, clip, accum, tier):
    args = [dtype, clip, str(accum), tier, str(tmp_path)]
    results = rank_results(run_ranks("_overlap_child.py", args, timeout_s=300))
    for runs in results:
        same_bits(runs["True"], runs["False"])
        assert min(a for a, _ in runs["True"]["ahead"]) > 0
    assert results[0]["True"]["losses"] != results[1]["True"]["losses"]  # each its own batch
