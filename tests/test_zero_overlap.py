"""The overlapped optimizer step (see [Note: the overlapped step] in infinity/zero/overlap.py):
bitwise the serial step's results in every case, and really stepping sub-groups early."""

from __future__ import annotations

import copy

import pytest
import torch
from _dist import rank_results, run_ranks
from _engine_models import batches, tiny_gpt
from _overlap import digest, overlap_config, same_bits, train

import infinity


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
    "dtype, clip, accum, tier, lora_r",
    [("fp16", "loose", 1, "nvme", 0), ("bf16", "biting", 4, "cpu", 4)],
)
def test_8_bit_moments_and_lora_overlapped_are_bitwise_serial(
    tmp_path, dtype, clip, accum, tier, lora_r
):
    """The 8-bit state (its codes and absmax copied and restored) and LoRA adapters (a frozen
    base: only the adapters' sub-groups step early), early steps kept and redone alike."""
    runs = {}
    for overlap in (False, True):
        cfg = overlap_config(
            dtype=dtype, clip=clip, accum=accum, tier=tier, overlap=overlap,
            nvme_dir=str(tmp_path / ("b" if overlap else "a")),
        )  # fmt: skip
        cfg["optimizer"]["type"] = "AdamW8bit"
        runs[overlap] = train(cfg, lora_r=lora_r)
    same_bits(runs[True], runs[False])
    kept = [c for a, c in runs[True]["ahead"] if a]
    assert len(kept) == len(runs[True]["ahead"])  # every step began during backward
    assert (max(kept) > 0) == (clip == "loose")


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


def test_ranks_that_stepped_different_sub_groups_early_agree(tmp_path):
    """How far each rank's worker got before the step is its own timing; the weights'
    publication (a collective refreshing the gathered copies) must come in the same order on
    every rank whatever was stepped early, kept or redone: here rank 1 steps one sub-group
    early, rank 0 all it can, and clipping bites (every early step redone). Before, the
    redone ones were published after the rest, in a rank's own order: the collectives did
    not match (gloo: "Received data size doesn't match expected size")."""
    args = ["fp32", "biting", "1", "cpu", str(tmp_path), "uneven"]
    results = rank_results(run_ranks("_overlap_child.py", args, timeout_s=120))
    for runs in results:
        same_bits(runs["True"], runs["False"])
    assert [min(a for a, _ in r["True"]["ahead"]) for r in results] == [
        min(a for a, _ in results[0]["True"]["ahead"]),
        1,
    ]


def _loop(overlap: bool, tmp_path, script) -> dict:
    """`script(engine, batches)` on the tiny GPT; weights and state digests after it."""
    cfg = overlap_config(
        dtype="bf16", clip="off", accum=1, tier="cpu", nvme_dir=str(tmp_path), overlap=overlap
    )
    torch.manual_seed(0)
    engine = infinity.initialize(copy.deepcopy(tiny_gpt(checkpointing=False)), cfg)
    try:
        ahead = script(engine, batches(6, seed=5))
        weights = {n: digest(w) for n, w in engine.named_parameters_host()}
        state = {n: digest(read()) for n, read in engine.parts.optimizer.state_tensors()}
    finally:
        engine.close()
    return {"weights": weights, "state": state, "ahead": ahead}


def test_a_second_backward_into_stepped_sub_groups_is_redone(tmp_path):
    def script(engine, data):
        ahead = []
        for i in range(0, 6, 2):  # two backwards at the boundary, one step
            for ids in data[i : i + 2]:
                engine.backward(engine(ids, ids))
                assert engine.parts.optimizer.wait_ahead()
            engine.step()
            t = engine.parts.optimizer.last_timings
            ahead.append((t.get("ahead_sub_groups", 0), t.get("ahead_confirmed", 0)))
        return ahead

    serial, overlapped = _loop(False, tmp_path, script), _loop(True, tmp_path, script)
    assert overlapped["weights"] == serial["weights"] and overlapped["state"] == serial["state"]
    # Stepped early after the first backward, spoiled by the second: none kept.
    assert all(stepped > 0 and kept == 0 for stepped, kept in overlapped["ahead"])


def test_a_window_the_loop_extends_undoes_what_began(tmp_path):
    def script(engine, data):
        for k, ids in enumerate(data):
            engine.backward(engine(ids, ids))
            assert engine.parts.optimizer.wait_ahead()
            engine.step(boundary=k % 3 == 2)  # the HF Trainer's own windows of 3
        return engine.global_steps

    serial, overlapped = _loop(False, tmp_path, script), _loop(True, tmp_path, script)
    assert serial["ahead"] == overlapped["ahead"] == 2
    assert overlapped["weights"] == serial["weights"] and overlapped["state"] == serial["state"]


def test_an_overlap_that_cannot_step_anything_early_says_why(tmp_path, caplog):
    """overlap_step on, the state on NVMe, the gradient sums not kept in RAM: nothing can be
    stepped early; the engine says so and names the key, instead of running serially in
    silence."""
    cfg = overlap_config(
        dtype="bf16", clip="off", accum=1, tier="nvme", nvme_dir=str(tmp_path), overlap=True
    )
    del cfg["zero_optimization"]["offload_optimizer"]["gradients_in_cpu"]
    with caplog.at_level("WARNING", logger="infinity.zero.overlap"):
        engine = infinity.initialize(tiny_gpt(checkpointing=False), cfg)
    engine.close()
    assert "overlap_step" in caplog.text and "gradients_in_cpu" in caplog.text, caplog.text


def test_an_overlap_whose_sums_stay_on_the_device_names_that_key(tmp_path, caplog):
    """The gradient sums all kept on the device: nothing is in host memory to step early;
    the warning names gradients_on_device, not a key that would change nothing."""
    cfg = overlap_config(
        dtype="bf16", clip="off", accum=1, tier="cpu", nvme_dir=str(tmp_path), overlap=True
    )
    cfg["zero_optimization"]["offload_optimizer"]["gradients_on_device"] = 10**9
    with caplog.at_level("WARNING", logger="infinity.zero.overlap"):
        engine = infinity.initialize(tiny_gpt(checkpointing=False), cfg)
    engine.close()
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "infinity.zero.overlap")
    assert "gradients_on_device" in said and "gradients_in_cpu" not in said, said
