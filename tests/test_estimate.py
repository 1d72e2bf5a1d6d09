"""`infinity.estimate`: bytes equal the engine's counters on tiny models (both tiers, live
budgets, accumulation, dtypes); the recorded bigger-than-RAM runs replay within 20%; LoRA
shapes; the CLI end to end and its errors."""

from __future__ import annotations

import glob
import json
import os
import pathlib
import sys

import pytest
import torch
from _resolve import resolve_config
from torch import nn

import infinity
from infinity.cli.main import main
from infinity.config import Config
from infinity.estimate import GPUS, Rates, estimate, model_shape, sizes
from infinity.estimate.hardware import probe_nvme, rates_from_bench_aio
from infinity.estimate.param_traffic import Pass, training_trace
from infinity.estimate.shapes import lora_numel
from infinity.estimate.sizing import layout_of
from infinity.models import LlamaConfig, LlamaForCausalLM, preset
from infinity.models.lora import LoraSpec, apply_lora
from infinity.swap.nvme_state import state_nbytes
from infinity.swap.split_state import state_in_ram
from infinity.swap.store import reserved_nbytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _config(
    path, *, param="nvme", optim="nvme", dtype="bf16", accum=1, optim_in_cpu=0,
    grads_in_cpu=False, grads_on_device=0, overlap_numel=0, **zero,
) -> dict:  # fmt: skip
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 20000,
            "stage3_param_persistence_threshold": 1000,
            "stage3_prefetch_bucket_size": 20000,
            "offload_param": {"device": param, "nvme_path": str(path)},
            "offload_optimizer": {
                "device": optim,
                "nvme_path": str(path),
                "max_in_cpu": optim_in_cpu,
                "gradients_in_cpu": grads_in_cpu,
                "gradients_on_device": grads_on_device,
            },
            **zero,
        },
    }
    if overlap_numel:  # else unset: the placement planner's to choose
        cfg["zero_optimization"]["offload_optimizer"] |= dict(
            overlap_step=True, overlap_numel=overlap_numel
        )
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def _swap_file_bytes(path: pathlib.Path) -> int:
    return sum(os.path.getsize(p) for p in path.rglob("*.swp"))


def _train(
    cfg: dict, path: pathlib.Path, steps: int = 3, lora_r: int = 0, checkpointing: bool = False,
    shape: dict = SHAPE,
) -> tuple[list[dict], int]:  # fmt: skip
    """memory_stats() after build and after each optimizer step; the swap files' bytes."""
    mc = LlamaConfig(**shape)
    torch.manual_seed(0)
    with infinity.init(cfg):
        model = LlamaForCausalLM(mc)
        if lora_r:
            model = apply_lora(model, LoraSpec(r=lora_r))
    model.set_gradient_checkpointing(checkpointing)
    engine = infinity.initialize(model, cfg)
    copies = engine.accelerator.copies

    def counters() -> dict:
        moved = copies.host_to_device_bytes + copies.device_to_host_bytes
        return {**engine.memory_stats(), "host_device_bytes": moved}

    try:
        stats = [counters()]
        disk = _swap_file_bytes(path)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            for _ in range(cfg["gradient_accumulation_steps"]):
                ids = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=g)
                engine.backward(engine(ids, ids))
                engine.step()
            stats.append(counters())
    finally:
        engine.close()
    return stats, disk


def _delta(stats: list[dict], key: str) -> int:
    return stats[-1].get(key, 0) - stats[-2].get(key, 0)


CASES = {
    "both-nvme-bf16": dict(),
    "both-nvme-small-budget": dict(stage3_max_live_parameters=30000),
    "both-nvme-accum-fp32": dict(dtype="fp32", accum=2, stage3_max_live_parameters=50000),
    "params-nvme-optim-cpu": dict(optim="cpu", stage3_max_live_parameters=50000),
    "params-cpu-optim-nvme": dict(param="cpu"),
    "params-cpu-optim-nvme-fp32": dict(param="cpu", dtype="fp32"),
    "both-cpu-fp16-accum": dict(param="cpu", optim="cpu", dtype="fp16", accum=3),
    "both-nvme-big-sub-groups": dict(sub_group_size=1_000_000),
    # The first sub-groups' state in RAM (offload_optimizer.max_in_cpu), the rest on NVMe.
    "optim-split-bf16": dict(param="cpu", optim_in_cpu=45000),
    "optim-split-fp32-accum2": dict(dtype="fp32", accum=2, optim_in_cpu=41000),
    "optim-nvme-device-all-in-ram": dict(optim_in_cpu=10**9),
    # The state on NVMe (part of it in RAM), every fp32 gradient in RAM across accumulation.
    "grads-in-ram-state-split-accum3": dict(accum=3, optim_in_cpu=41000, grads_in_cpu=True),
    "grads-in-ram-state-nvme-fp32": dict(dtype="fp32", param="cpu", grads_in_cpu=True),
    # The first sub-groups' gradient sums on the device, the rest in RAM or spilled.
    "grads-on-device-all-accum2": dict(accum=2, grads_on_device=10**9),
    "grads-on-device-then-nvme-accum3": dict(accum=3, grads_on_device=41000),
    "grads-on-device-host-nvme-fp32": dict(
        dtype="fp32", optim_in_cpu=82000, grads_on_device=41000
    ),  # fmt: skip
    "grads-on-device-state-in-ram": dict(param="cpu", optim="cpu", grads_on_device=41000),
}
# The overlapped step's state copies, for the sub-groups it may step early (see [Note: the
# overlapped step's copies]): every tier of the gradients and the state, fp32 aliasing.
for _name, _spec in {
    "state-in-ram-bf16": dict(param="cpu", optim="cpu"),
    "state-in-ram-fp32-aliased": dict(param="cpu", optim="cpu", dtype="fp32"),
    "params-nvme-state-in-ram-fp16": dict(optim="cpu", dtype="fp16"),
    "grads-in-ram-state-nvme-accum2": dict(accum=2, grads_in_cpu=True),
    # The last sub-groups' sums spilled: backward finishes those first, none is early.
    "none-state-split-grads-spilled": dict(param="cpu", optim_in_cpu=41000),
    "grads-on-device-first": dict(optim="cpu", grads_on_device=41000),
}.items():
    CASES[f"overlap-{_name}"] = dict(overlap_numel=10**9, **_spec)
CASES["overlap-numel-limit"] = dict(param="cpu", optim="cpu", overlap_numel=50000)
# Spilled gradients over accumulation windows: which sub-groups backward finds in a buffer,
# reads back whole, or adds to on disk row by row depends on the window and the sub-groups.
for _accum, _sgs, _param, _dtype in (
    (2, 20000, "nvme", "bf16"),
    (3, 20000, "nvme", "bf16"),
    (2, 60000, "cpu", "bf16"),
    (3, 60000, "cpu", "fp16"),
    (4, 20000, "cpu", "fp32"),
    (3, 9000, "nvme", "fp32"),
):
    CASES[f"grads-accum{_accum}-sg{_sgs}-params-{_param}-{_dtype}"] = dict(
        accum=_accum, sub_group_size=_sgs, param=_param, dtype=_dtype
    )
# Trainable weights kept on the device across the micro batches of a step: all of them, or
# the first that fit a budget (the rest gathered at every micro batch as before).
for _accum, _keep, _param in ((3, 10**9, "nvme"), (4, 60000, "nvme"), (2, 60000, "cpu")):
    CASES[f"keep-{_keep}-accum{_accum}-params-{_param}"] = dict(
        accum=_accum, param=_param, keep_weights_numel=_keep, stage3_max_live_parameters=30000
    )
CASES["keep-lora-accum3"] = dict(
    accum=3, lora_r=4, sub_group_size=1000, keep_weights_numel=4000,
    stage3_param_persistence_threshold=100,  # the adapters are not persistent
)  # fmt: skip
# LoRA: the adapters train, the base is frozen in its tier (on NVMe it fits the budget here,
# so it stays gathered after the first step and is read no more).
for _accum, _param, _optim in ((1, "cpu", "nvme"), (3, "nvme", "nvme"), (2, "nvme", "cpu")):
    CASES[f"lora-accum{_accum}-params-{_param}-optim-{_optim}"] = dict(
        accum=_accum, param=_param, optim=_optim, lora_r=4, sub_group_size=1000
    )
# All adapters in one sub-group: the optimizer's NVMe pipeline allocates one buffer.
CASES["lora-one-sub-group"] = dict(lora_r=4, sub_group_size=10**8)
# A frozen base larger than the live budget: evicted only when room is needed, so the next
# forward finds what the last backward used (the closed form for trainable parameters
# counted 9-39% more).
for _budget in (30000, 45000, 120000):
    CASES[f"lora-base-over-budget-{_budget}"] = dict(
        lora_r=4, sub_group_size=1000, stage3_max_live_parameters=_budget
    )


def test_an_outlier_embedding_stages_through_its_own_buffer(tmp_path):
    """An embedding 6x the largest linear layer gets the staging pool's outlier buffer (see
    [Note: an outlier's own buffer] in infinity/swap/pool.py): the pool is smaller than five
    buffers of it, the engine's equals the estimate's, and the NVMe bytes are as planned."""
    big = {**SHAPE, "vocab_size": 1 << 16}  # a 4.2M-element embedding, 10,240-element MLP
    cfg = _config(tmp_path)
    stats, _ = _train(cfg, tmp_path, shape=big)
    shape = model_shape(LlamaConfig(**big))
    sz = sizes(shape, resolve_config(Config.load(cfg), shape), pins=False)
    assert stats[-1]["param_pool_bytes"] == sz.param_pool_bytes < 2 * (1 << 22) * 2
    assert _delta(stats, "nvme_param_bytes_read") == sz.param_read_bytes_per_micro_step > 0
    assert _delta(stats, "nvme_param_bytes_written") == sz.param_write_bytes_per_step


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bytes_equal_the_engine_counters(tmp_path, case):
    spec = dict(CASES[case])
    lora_r = spec.pop("lora_r", 0)
    cfg = _config(tmp_path, **spec)
    stats, disk = _train(cfg, tmp_path, lora_r=lora_r)
    shape = model_shape(LlamaConfig(**SHAPE), lora_r=lora_r)
    resolved = resolve_config(Config.load(cfg), shape)
    sz = sizes(shape, resolved, pins=False)
    sz_numels = layout_of(shape, resolved).sub_group_numels
    accum = cfg["gradient_accumulation_steps"]
    assert _delta(stats, "nvme_optim_bytes_read") == sz.optim_read_bytes_per_step
    assert _delta(stats, "nvme_optim_bytes_written") == sz.optim_write_bytes_per_step
    assert _delta(stats, "nvme_param_bytes_written") == sz.param_write_bytes_per_step
    assert _delta(stats, "nvme_param_bytes_read") == sz.param_read_bytes_per_step(accum)
    assert _delta(stats, "nvme_grad_bytes_read") == sz.grad_read_bytes_per_step
    assert _delta(stats, "nvme_grad_bytes_written") == sz.grad_write_bytes_per_step
    assert _delta(stats, "host_device_bytes") == sz.host_device_bytes_per_step(accum)
    # Kept weights: held on the device as planned, read and copied once a step.
    assert stats[-1]["peak_kept_param_numel"] * sz.itemsize == sz.kept_device_bytes
    assert (sz.kept_device_bytes > 0) == case.startswith("keep")
    if case.startswith("keep") and "params-nvme" in case:
        assert 0 < sz.kept_read_bytes_per_step <= sz.kept_gather_bytes_per_step
    assert stats[-1]["grad_bytes"] == sz.grad_host_bytes
    assert stats[-1].get("grad_device_bytes", 0) == sz.grad_device_bytes
    assert (sz.grad_device_bytes > 0) == ("on-device" in case)
    assert disk == sz.nvme_bytes
    assert stats[-1]["host_bytes"] == sz.host_bytes
    assert stats[-1]["optim_overlap_bytes"] == sz.overlap_host_bytes
    assert (sz.overlap_host_bytes > 0) == ("overlap" in case and "none" not in case)
    assert stats[-1]["optim_overlap_peak_bytes"] <= sz.overlap_host_bytes
    assert stats[-1]["pinned_bytes"] == sz.pinned_bytes
    in_ram = sum(sz_numels[: state_in_ram(sz_numels, resolved.zero_optimization.offload_optimizer)])
    assert stats[-1].get("optim_host_buffer_bytes", 0) == sz.state_host_bytes - 12 * in_ram
    assert stats[-1].get("param_pool_bytes", 0) == sz.param_pool_bytes
    # The engine's peak live set is the replayed policy's; with a frozen base just over the
    # budget (kept across iterations) the first iterations can peak one small unit apart.
    peak = stats[-1]["peak_live_param_numel"]
    if case.startswith("lora-base-over-budget"):
        assert abs(peak - sz.peak_live_numel) <= max(p.numel for p in shape.params)
    else:
        assert peak == sz.peak_live_numel


def test_budget_cutting_inside_a_layer_is_exact(tmp_path):
    """A budget that ends inside a block: which of its small units stay gathered at the turn
    follows from the coordinator's policy replayed (a rule of whole units was one off)."""
    cfg = _config(tmp_path, stage3_max_live_parameters=70000)
    stats, _ = _train(cfg, tmp_path)
    shape = model_shape(LlamaConfig(**SHAPE))
    sz = sizes(shape, resolve_config(Config.load(cfg), shape), pins=False)
    assert _delta(stats, "nvme_param_bytes_read") == sz.param_read_bytes_per_micro_step
    assert _delta(stats, "nvme_optim_bytes_read") == sz.optim_read_bytes_per_step


@pytest.mark.parametrize(
    ("lora_r", "budget"), [(4, 45000), (0, 120000)], ids=["lora-base-over-budget", "full"]
)
def test_checkpointed_reads_equal_the_engine(tmp_path, lora_r, budget):
    """Under activation checkpointing backward recomputes each block before it needs it
    again: the replayed order of gathers reads what the engine reads."""
    cfg = _config(tmp_path, stage3_max_live_parameters=budget)
    stats, _ = _train(cfg, tmp_path, lora_r=lora_r, checkpointing=True)
    shape = model_shape(LlamaConfig(**SHAPE), lora_r=lora_r)
    sz = sizes(shape, resolve_config(Config.load(cfg), shape), pins=False, checkpointing=True)
    assert _delta(stats, "nvme_param_bytes_read") == sz.param_read_bytes_per_micro_step


def test_small_budget_re_reads_parameters_in_backward(tmp_path):
    """The budget decides what backward reads again: a tight one costs more NVMe reads."""
    shape = model_shape(LlamaConfig(**SHAPE))
    reads = []
    for budget in (30000, 1_000_000):
        cfg = Config.load(_config(tmp_path, stage3_max_live_parameters=budget))
        reads.append(sizes(shape, resolve_config(cfg, shape), pins=False))
    tight, roomy = (s.param_read_bytes_per_micro_step for s in reads)
    assert tight > roomy > 0


# -- the recorded runs --------------------------------------------------------------------------


def _replays() -> tuple:
    sys.path.insert(0, str(ROOT))
    from benchmarks import estimate_vs_measured as evm

    files = sorted(glob.glob(str(ROOT / "benchmarks/results/estimate_vs_measured_*.json")))
    assert files, "benchmarks/results has no estimate_vs_measured_*.json to replay"
    with open(files[-1]) as f:
        return evm, {run["record"]: run for run in json.load(f)["runs"]}


# Runs whose bytes today's engine no longer moves: 2.1B runs 1 and 2 read 49 persistent
# parameters back from disk after each step, the 2026-11-22 507M runs laid sub-groups out
# per parameter. Only their peak RSS (and step time, see below) is compared.
OLD_LAYOUT = ("2.1B_nvme_run1", "2.1B_nvme_run2", "2026-11-22_500M")


BUFFERS_PER_SUB_GROUP_SINCE = "2026-11-23T15:30"
"""Runs recorded before then allocated every offload_optimizer.buffer_count buffer even for
fewer sub-groups (LoRA: one); the extra ones were never resident, so only host_bytes
differ, by exactly them."""


def _unused_buffer_bytes(record: dict, est) -> int:
    if record["machine"]["date"] >= BUFFERS_PER_SUB_GROUP_SINCE:
        return 0
    if est.inputs["offload_optimizer"] != "nvme":
        return 0
    count = record["config"]["zero_optimization"]["offload_optimizer"]["buffer_count"]
    used = min(count, est.sizes.num_sub_groups)
    return (count - used) * (est.sizes.state_host_bytes // used)


STILL_SHORT = {
    "benchmarks/results/bigger_than_ram_2026-11-26_2.1B_nvme_run1_quiet.json": (
        "full fine-tuning at 2.1B with both tiers on NVMe on a machine whose cores are slower "
        "than the disk's: forward and backward 10.9 s estimated against 16.4 s measured "
        "(parameter reads waited 0.9-1.0 s, gradients 3.1-3.2 s, and backward ran 13-14 s "
        "where the model has about 9 s); the estimate's step lands at 0.79. Recorded on the "
        "engine before a 16-bit gradient was added into fp32 in pieces: 2.3 s of that "
        "backward was a gradient-sized fp32 copy per add, which run 2 no longer makes (0.92)"
    ),
}
"""Recorded runs whose step the estimate is known to miss by more than 20%, and why: the
golden test checks that they still do, so a model that catches up says so."""


def test_recorded_runs_replay_within_20_percent():
    """Every recorded bigger_than_ram run, replayed: bytes equal the engine's counters and
    peak RSS lands within 20%; the whole step of full fine-tuning within 20% where the run
    had the machine (its load average no higher than its cores: other work on the two cores
    slows forward and backward 2-6x from one minute to the next) and recorded the
    estimate's rate probes itself (a probe taken at replay time measures another machine
    state: the 2026-11-22 runs replay at 0.70-0.94 depending on it). The optimizer step
    alone is not asserted: it lands at 0.87-1.24, and above 1 because its counters give it more
    traffic than the disk can move in the time measured (500M: 15 GB in 3.2 s, 4.6 GB/s,
    where `bench aio` measures 3.1-3.2 GB/s read, 3.9-4.2 write and 3.4-3.8 both at once):
    part of it runs outside the step's timer, and the model does not place it. LoRA steps
    are timed where the run's engine probe had its block sizes (see [Note: probing at the
    run's sizes] in infinity/run/engine_costs.py); the earlier LoRA runs probed a tiny
    model, which costs the engine less than half as much per module, and replay at
    0.60-0.96 (BENCHMARKS.md lists every ratio and where that step's time goes)."""
    evm, replays = _replays()
    records = sorted(glob.glob(str(ROOT / "benchmarks/results/bigger_than_ram_*.json")))
    records = [str(pathlib.Path(r).relative_to(ROOT)) for r in records]
    missing = [r for r in records if r not in replays]
    assert not missing, f"replay {missing} with benchmarks/estimate_vs_measured.py"
    kinds, timed, lora_timed = set(), 0, 0
    for path in records:
        with open(ROOT / path) as f:
            record = json.load(f)
        est = evm.estimate_record(record, replays[path]["probed"])
        got, want = evm.predicted(est), evm.measured(record)
        kinds.add((record["model"]["params"] > 1e9, est.inputs["offload_param"], est.params))
        if any(tag in path for tag in OLD_LAYOUT):
            continue
        assert abs(got["peak_rss_bytes"] / want["peak_rss_bytes"] - 1) <= 0.2, path
        assert got["host_bytes"] + _unused_buffer_bytes(record, est) == want["host_bytes"], path
        assert got["nvme_write_bytes_per_step"] == want["nvme_write_bytes_per_step"], path
        reads, measured_reads = got["nvme_read_bytes_per_step"], want["nvme_read_bytes_per_step"]
        assert reads == measured_reads, path  # LoRA bases over the budget included
    for path in records:
        with open(ROOT / path) as f:
            record = json.load(f)
        machine = record["machine"]
        if machine["loadavg_end"][0] > (machine.get("cpus") or machine["cores"]):
            continue
        if replays[path]["probed"].get("source") != "record":
            continue
        est = evm.estimate_record(record, replays[path]["probed"])
        if est.inputs["lora_r"] and not replays[path]["probed"].get("engine_probe_run_sized"):
            continue
        got, want = evm.predicted(est), evm.measured(record)
        ratio = got["step_seconds"] / want["step_seconds"]
        if path in STILL_SHORT:
            assert ratio < 0.8, f"{path} now lands at {ratio:.2f}: take it out of STILL_SHORT"
            continue
        assert abs(ratio - 1) <= 0.2, (path, got["step_seconds"], want["step_seconds"])
        timed += 1
        lora_timed += bool(est.inputs["lora_r"])
    assert timed
    assert lora_timed
    assert {(False, "cpu"), (True, "nvme")} <= {k[:2] for k in kinds}


# -- shapes -------------------------------------------------------------------------------------


def test_model_shape_matches_the_model():
    mc = LlamaConfig(**SHAPE, tie_word_embeddings=True)
    shape = model_shape(mc)
    model = LlamaForCausalLM(mc)
    assert [(p.name, p.numel) for p in shape.params] == [
        (n, p.numel()) for n, p in model.named_parameters()
    ]
    assert shape.numel == mc.num_params
    assert shape.units[0].name == "model.embed_tokens"
    assert shape.units[-1].name == "lm_head"


def test_lora_adapters_from_shapes():
    mc = LlamaConfig(**SHAPE)
    r = 4
    shape = model_shape(mc, lora_r=r)
    block = [lin for lin in shape.linears if ".layers." in lin.name]
    assert len(block) == 7 * mc.num_hidden_layers
    assert shape.trainable_numel == sum(lora_numel(lin, r) for lin in block)
    assert shape.numel == mc.num_params + shape.trainable_numel
    sz = sizes(shape, resolve_config(Config.load({}), shape), pins=False)
    assert sz.frozen_host_bytes == 4 * mc.num_params  # fp32 base weights in RAM
    assert sz.grad_host_bytes == 4 * sz.flat_numel < 4 * mc.num_params  # adapters only


def test_lora_compute_probe_times_the_adapters_peft_adds():
    """The CPU compute probe of a LoRA run times blocks carrying the adapters the run trains
    (every linear layer of the block, in the model dtype, the base frozen), not bare frozen
    blocks."""
    from infinity.estimate import hardware
    from infinity.models.llama import LlamaDecoderLayer

    mc = LlamaConfig(**SHAPE)
    block = hardware._adapted(hardware._filled(LlamaDecoderLayer(mc), torch.bfloat16, True), 4)
    adapters = {n: p for n, p in block.named_parameters() if ".lora_" in n}
    linears = [n for n, m in LlamaDecoderLayer(mc).named_modules() if isinstance(m, nn.Linear)]
    assert len(adapters) == 2 * len(linears) == 14
    assert all(p.requires_grad and p.dtype == torch.bfloat16 for p in adapters.values())
    assert not any(p.requires_grad for n, p in block.named_parameters() if n not in adapters)
    assert hardware.probe_compute_s(mc, 1, 8, torch.bfloat16, lora_r=4, checkpointing=True) > 0


def test_lora_rank_must_be_positive():
    with pytest.raises(ValueError, match="lora_r"):
        model_shape(LlamaConfig(**SHAPE), lora_r=-1)


# -- timing and the bound -----------------------------------------------------------------------


def _rates(**overrides) -> Rates:
    base = dict(device="cpu", gpu=None, compute_s=4.0, adam_numel_per_s=1e9,
                norm_bytes_per_s=2e10, copy_bytes_per_s=1e10, nvme_read_bps=2e9,
                nvme_write_bps=2e9)  # fmt: skip
    return Rates(**{**base, **overrides})


def test_slow_disk_bounds_and_advice_names_the_fix(tmp_path):
    shape = model_shape(preset("llama-1b"))
    cfg = Config.load(_config(tmp_path, sub_group_size=100_000_000))
    slow = estimate(shape, cfg, _rates(nvme_read_bps=1e8, nvme_write_bps=1e8), seq_len=128,
                    runtime_bytes=0, ram_bytes=1 << 40)  # fmt: skip
    assert slow.bound == "nvme"
    assert any("grad-accum" in a for a in slow.advice)
    assert any('offload_param.device "cpu"' in a for a in slow.advice)
    fast = estimate(shape, cfg, _rates(nvme_read_bps=1e12, nvme_write_bps=1e12, compute_s=200.0),
                    seq_len=128, runtime_bytes=0)  # fmt: skip
    assert fast.bound == "compute"
    assert fast.times.step_s < slow.times.step_s


def test_accumulation_spreads_the_optimizer_over_more_tokens(tmp_path):
    shape = model_shape(LlamaConfig(**SHAPE))
    one = estimate(shape, Config.load(_config(tmp_path)), _rates(), seq_len=64, runtime_bytes=0)
    four = estimate(shape, Config.load(_config(tmp_path, accum=4)), _rates(), seq_len=64,
                    runtime_bytes=0)  # fmt: skip
    assert four.times.optimizer_step_s == pytest.approx(one.times.optimizer_step_s)

    # spilled gradients: more micro-steps read more of them back, under the compute here
    assert four.sizes.grad_read_bytes_per_step > one.sizes.grad_read_bytes_per_step > 0
    assert four.bound == one.bound == "compute"
    # each micro step's cores once more; the waits for reads and for gradients as the four
    # replay them
    one_t, four_t = one.times, four.times
    cores = one_t.compute_s + one_t.copies_s + one_t.hooks_s
    waits = four_t.grad_wait_s - one_t.grad_wait_s + four_t.read_wait_s - one_t.read_wait_s
    assert four_t.step_s == pytest.approx(one_t.step_s + 3 * cores + waits, rel=1e-9)
    # ... and over a slow disk they bound the window: it grows with the traffic
    slow = _rates(nvme_read_bps=1e5, nvme_write_bps=1e5)
    one_slow, four_slow = (
        estimate(shape, Config.load(_config(tmp_path, accum=a)), slow, seq_len=64,
                 runtime_bytes=0)
        for a in (1, 4)
    )  # fmt: skip
    s = four_slow.sizes
    window = (s.grad_read_bytes_per_step - s.grad_step_read_bytes + s.grad_write_bytes_per_step
              + 4 * s.param_read_bytes_per_micro_step + s.optim_ahead_read_bytes) / 1e5  # fmt: skip
    assert four_slow.times.micro_step_s * 4 == pytest.approx(window)
    assert four_slow.bound == one_slow.bound == "nvme"


def test_gpu_device_memory_overflow_is_reported(tmp_path):
    shape = model_shape(preset("llama-7b"))
    cfg = Config.load({"train_micro_batch_size_per_gpu": 16, "bf16": {"enabled": True}})
    est = estimate(shape, cfg, _rates(device="4090", gpu=GPUS["4090"]), seq_len=4096,
                   runtime_bytes=0)  # fmt: skip
    assert est.device_bytes > GPUS["4090"].memory_bytes
    assert any("activation-checkpointing" in a for a in est.advice)
    # Parameters in RAM: no staging pool, and the 16-bit homes are pinned.
    assert est.sizes.pinned_bytes == est.sizes.weights_host_bytes


def test_bench_aio_file_gives_best_overwrite_rates(tmp_path):
    path = tmp_path / "aio.json"
    path.write_text(json.dumps([
        {"op": "read", "gbps": 1.5, "fresh_file": False},
        {"op": "read", "gbps": 2.5, "fresh_file": False},
        {"op": "write", "gbps": 9.0, "fresh_file": True},
        {"op": "write", "gbps": 4.0, "fresh_file": False},
    ]))  # fmt: skip
    assert rates_from_bench_aio(path) == (2.5e9, 4.0e9)
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match="no read and write records"):
        rates_from_bench_aio(bad)


# -- the command line ---------------------------------------------------------------------------


def test_cli_prints_and_writes_json(tmp_path, capsys):
    aio = tmp_path / "aio.json"
    aio.write_text(json.dumps([{"op": "read", "gbps": 3.0}, {"op": "write", "gbps": 2.0}]))
    out = tmp_path / "est.json"
    code = main(["estimate", "--model", "llama-13b", "--nvme", str(tmp_path / "ssd"),
                 "--placement", "nvme", "--device", "h100", "--dtype", "bf16",
                 "--bench-aio", str(aio), "--json", str(out)])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "host RAM, peak" in text and "bound:" in text
    d = json.loads(out.read_text())
    for key in ("peak_rss_bytes", "pinned_bytes", "device_bytes", "nvme_bytes",
                "nvme_read_bytes_per_step", "nvme_write_bytes_per_step", "step_seconds",
                "bound"):  # fmt: skip
        assert key in d
    # 13B with both tiers on NVMe: 12 bytes/param of state read and written, 2 of weights,
    # and the fp32 gradients spilled to NVMe (each sub-group written at least once but those
    # still in the host buffers at the step; see infinity.estimate.grad_traffic)
    n = d["trainable_params"]
    grad_write = d["terms"]["grad_write_bytes_per_step"]
    assert grad_write > 3.9 * n
    assert 14 * n <= d["nvme_write_bytes_per_step"] - grad_write < 14.01 * n
    assert "gradients" in text
    assert d["nvme_bytes"] >= 14 * n
    assert d["pinned_bytes"] > 0  # the parameter staging pool on a GPU
    assert d["bound"] in ("compute", "nvme", "cpu_adam", "copies")
    assert d["rates"]["nvme_read_bps"] == 3.0e9


def test_cli_lora_trains_fewer_parameters(tmp_path, capsys):
    args = ["estimate", "--model", "tiny", "--device", "a100", "--json"]
    assert main([*args, str(tmp_path / "full.json")]) == 0
    assert main([*args, str(tmp_path / "lora.json"), "--lora-r", "2"]) == 0
    full = json.loads((tmp_path / "full.json").read_text())
    lora = json.loads((tmp_path / "lora.json").read_text())
    assert lora["trainable_params"] < full["trainable_params"] / 5
    assert "LoRA r=2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nope-7b"], "not a preset"),
        (["--model", "tiny", "--bench-aio", "/no/such.json"], "no such file"),
        (["--model", "tiny", "--config", "/no/such.json"], "such.json"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys):
    assert main(["estimate", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_nvme_probe_measures_and_leaves_nothing(tmp_path):
    read, write = probe_nvme(tmp_path, 8 << 20)
    assert read > 0 and write > 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="not a writable directory"):
        probe_nvme(tmp_path / "missing")


def test_cli_probes_an_existing_nvme_directory(tmp_path, capsys):
    out = tmp_path / "est.json"
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    assert (
        main(
            [
                "estimate",
                "--model",
                "tiny",
                "--nvme",
                str(ssd),
                "--placement",
                "nvme",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    d = json.loads(out.read_text())
    assert d["rates"]["sources"]["nvme"].startswith("probe:")
    assert d["nvme_read_bytes_per_step"] > 0 and d["nvme_bytes"] > 0
    assert list(ssd.iterdir()) == []


def test_too_little_ram_points_at_nvme(tmp_path):
    shape = model_shape(preset("llama-1b"))
    cfg = Config.load({})  # everything in host memory
    in_ram = estimate(shape, cfg, _rates(), seq_len=64, runtime_bytes=0, ram_bytes=8 << 30)
    assert in_ram.peak_rss_bytes > 8 << 30
    assert any("--nvme PATH" in a for a in in_ram.advice)
    on_nvme = Config.load(_config(tmp_path, sub_group_size=100_000_000))
    est = estimate(shape, on_nvme, _rates(), seq_len=64, runtime_bytes=0, ram_bytes=8 << 30)
    assert est.peak_rss_bytes < in_ram.peak_rss_bytes / 1.5  # the state left RAM
    assert any("sub_group_size" in a for a in est.advice)


def test_cli_refuses_a_stage_the_engine_refuses(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    assert main(["estimate", "--model", "tiny", "--config", str(cfg)]) == 1
    assert "stage: 5 is not a ZeRO stage" in capsys.readouterr().err


def test_unpipelined_optimizer_adds_adam_and_transfers(tmp_path):
    shape = model_shape(LlamaConfig(**SHAPE))
    on = estimate(shape, Config.load(_config(tmp_path)), _rates(), seq_len=64, runtime_bytes=0)
    raw = _config(tmp_path)
    raw["zero_optimization"]["offload_optimizer"]["pipeline_read"] = False
    off = estimate(shape, Config.load(raw), _rates(), seq_len=64, runtime_bytes=0)
    assert off.times.optimizer_step_s > on.times.optimizer_step_s
    # without the read pipeline nothing is read ahead during forward and backward
    assert off.sizes.optim_ahead_read_bytes == 0 < on.sizes.optim_ahead_read_bytes

    def state_io(e):
        s = e.sizes
        return (s.optim_read_bytes_per_step - s.optim_ahead_read_bytes + s.grad_step_read_bytes
                + s.optim_write_bytes_per_step + s.param_write_bytes_per_step) / 2e9  # fmt: skip

    adam, norm = off.sizes.flat_numel / 1e9, off.sizes.grad_host_bytes / 2e10
    assert off.times.optimizer_step_s == pytest.approx(adam + state_io(off) + norm)
    assert on.times.optimizer_step_s == pytest.approx(max(adam, state_io(on)) + norm)


def test_pinned_bytes_on_a_gpu_follow_pin_memory(tmp_path):
    shape = model_shape(LlamaConfig(**SHAPE))
    raw = _config(tmp_path)
    unpinned = sizes(shape, resolve_config(Config.load(raw), shape), pins=True)
    assert unpinned.pinned_bytes == unpinned.param_pool_bytes  # offload_param pins by default
    raw["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
    pinned = sizes(shape, resolve_config(Config.load(raw), shape), pins=True)
    assert pinned.pinned_bytes == pinned.param_pool_bytes + pinned.state_host_bytes
    assert sizes(shape, resolve_config(Config.load(raw), shape), pins=False).pinned_bytes == 0


@pytest.mark.parametrize("lora_r", [0, 4])
def test_module_count_is_what_the_engine_hooks(lora_r):
    mc = LlamaConfig(**SHAPE)
    model = LlamaForCausalLM(mc)
    if lora_r:
        model = apply_lora(model, LoraSpec(r=lora_r))
    hooked = sum(1 for m in model.modules() if next(m.parameters(recurse=False), None) is not None)
    assert model_shape(mc, lora_r=lora_r).modules == hooked


def test_engine_hooks_add_on_the_cpu_device_only(tmp_path):
    shape = model_shape(LlamaConfig(**SHAPE), lora_r=4)
    cfg = Config.load(_config(tmp_path, accum=2))
    bare = estimate(shape, cfg, _rates(), seq_len=64, runtime_bytes=0)
    hooked = estimate(shape, cfg, _rates(module_overhead_s=1e-3), seq_len=64, runtime_bytes=0)
    assert hooked.times.hooks_s == pytest.approx(2 * shape.modules * 1e-3)
    assert hooked.times.step_s == pytest.approx(bare.times.step_s + hooked.times.hooks_s)
    gpu = _rates(device="a100", gpu=GPUS["a100"], module_overhead_s=1e-3)
    assert estimate(shape, cfg, gpu, seq_len=64, runtime_bytes=0).times.hooks_s == 0.0


def test_gathers_from_nvme_copy_at_the_rate_the_engine_probe_saw(tmp_path):
    """On the CPU device a gather from NVMe is copied at the engine probe's gather-copy rate
    when there is one (else the plain copy rate); gathers that alias RAM homes copy
    nothing, whatever the rate."""
    shape = model_shape(LlamaConfig(**SHAPE), lora_r=4)
    cfg = Config.load(_config(tmp_path, optim="cpu", stage3_max_live_parameters=45000))

    def copies(**rates):
        return estimate(shape, cfg, _rates(**rates), seq_len=16, runtime_bytes=0)

    plain, probed = copies(), copies(gather_copy_bytes_per_s=2.5e9)  # a quarter of 1e10
    gathered = plain.sizes.gather_bytes_per_micro_step
    assert gathered > 0
    extra = gathered / 2.5e9 - gathered / 1e10
    assert probed.times.copies_s == pytest.approx(plain.times.copies_s + extra)
    host = Config.load(_config(tmp_path, param="cpu"))
    same = [estimate(shape, host, _rates(**r), seq_len=16, runtime_bytes=0).times.copies_s
            for r in ({}, {"gather_copy_bytes_per_s": 2.5e9})]  # fmt: skip
    assert same[0] == same[1]


def test_backward_waits_for_gradient_transfers_it_cannot_run_ahead_of(tmp_path):
    """Sub-groups smaller than a layer: a layer's gradients span three sub-groups while two
    buffers take adds, so backward reads sub-groups back (after their writes land) and adds
    norm weights on disk, and waits for both; with one sub-group nothing is waited for.
    The step's cores pay those bytes at the disk's rates."""
    from infinity.estimate.grad_traffic import grad_traffic

    shape = model_shape(LlamaConfig(**SHAPE))
    waited = {}
    for sub_group in (3000, 10**8):
        cfg = resolve_config(Config.load(_config(tmp_path, sub_group_size=sub_group)), shape)
        t = grad_traffic(shape, layout_of(shape, cfg), accum=1)
        waited[sub_group] = t
        assert t.backward_waited_read <= t.read - t.step_read  # of what backward reads
        assert t.backward_waited_written <= t.written
    small, one = waited[3000], waited[10**8]
    assert small.backward_waited_read > 0 and small.backward_waited_written > 0
    assert one.backward_waited_read == one.backward_waited_written == 0
    cfg = Config.load(_config(tmp_path, sub_group_size=3000))
    rates = _rates(nvme_read_bps=1e9, nvme_write_bps=5e8, compute_s=100.0)  # the cores bound
    est = estimate(shape, cfg, rates, seq_len=16, runtime_bytes=0)
    wait = small.backward_waited_read / 1e9 + small.backward_waited_written / 5e8
    assert est.sizes.grad_waited_read_bytes_per_step == small.backward_waited_read
    assert est.times.grad_wait_s == pytest.approx(wait)
    t = est.times
    cores = t.compute_s + t.copies_s + t.hooks_s + t.read_wait_s  # one micro step
    assert t.micro_step_s == pytest.approx(cores + t.grad_wait_s)
    disk_bound = _rates(nvme_read_bps=1e9, nvme_write_bps=1e9, compute_s=1e-4)
    assert any("sub_group_size" in a for a in estimate(shape, cfg, disk_bound, seq_len=16).advice)


def test_optimizer_buffers_no_more_than_sub_groups(tmp_path):
    """LoRA adapters in one sub-group get one NVMe pipeline buffer, not buffer_count (4):
    host bytes, steady RSS and the engine's allocation follow (the engine side is
    test_bytes_equal_the_engine_counters' lora cases)."""
    shape = model_shape(LlamaConfig(**SHAPE), lora_r=4)
    one = Config.load(_config(tmp_path, sub_group_size=10**8))
    many = Config.load(_config(tmp_path, sub_group_size=1000))
    a, b = (estimate(shape, c, _rates(), seq_len=16, runtime_bytes=0) for c in (one, many))
    assert a.sizes.num_sub_groups == 1 and b.sizes.num_sub_groups > 4
    extent = a.sizes.optim_nvme_bytes  # the one sub-group's state, page-padded
    assert a.sizes.state_host_bytes == extent
    assert a.steady_rss_bytes == a.sizes.host_bytes + a.device_bytes
    layout = layout_of(shape, resolve_config(many, shape))
    largest = max(reserved_nbytes(state_nbytes(n)) for n in layout.sub_group_numels)
    assert b.sizes.state_host_bytes == 4 * largest  # 42 sub-groups: all four buffers


def test_reads_the_prefetch_window_cannot_hide_make_the_cores_wait(tmp_path):
    """Parameters on NVMe, CPU device: a micro step is the cores' work when the disk keeps
    ahead, and grows by what they wait for reads when it cannot (a slow disk, a prefetch
    window of one small unit, one staging buffer); parameters in RAM never wait."""
    shape = model_shape(LlamaConfig(**SHAPE), lora_r=4)
    cfg = Config.load(_config(tmp_path, optim="cpu", stage3_max_live_parameters=45000))

    def times(read_bps, **zero):
        c = Config.load(_config(tmp_path, optim="cpu", stage3_max_live_parameters=45000, **zero))
        rates = _rates(nvme_read_bps=read_bps, compute_s=0.1, module_overhead_s=1e-4)
        return estimate(shape, c, rates, seq_len=16, runtime_bytes=0).times

    fast = times(1e13)
    cores = fast.compute_s + fast.copies_s + fast.hooks_s
    assert fast.read_wait_s == pytest.approx(0.0, abs=1e-6)
    assert fast.micro_step_s == pytest.approx(cores)
    reads = sizes(shape, resolve_config(cfg, shape), pins=False).param_read_bytes_per_micro_step
    slow = times(reads / 0.2)  # the reads alone take 0.2 s, twice the compute
    assert slow.read_wait_s > 0.2 - cores
    assert slow.micro_step_s == pytest.approx(cores + slow.read_wait_s)
    narrow = times(reads / 0.05, stage3_prefetch_bucket_size=1)
    wide = times(reads / 0.05, stage3_prefetch_bucket_size=10**6)
    assert narrow.read_wait_s > wide.read_wait_s
    one_buffer = times(reads / 0.05, offload_param={"device": "nvme", "nvme_path": str(tmp_path),
                                                    "buffer_count": 1})  # fmt: skip
    assert one_buffer.read_wait_s > wide.read_wait_s
    host = estimate(shape, Config.load(_config(tmp_path, param="cpu")), _rates(compute_s=0.1),
                    seq_len=16, runtime_bytes=0).times  # fmt: skip
    assert host.read_wait_s == 0.0


def test_backward_gathers_only_where_a_gradient_flows_out():
    """Recorded on the meta device, not guessed from names: with LoRA the embedding and the
    first adapted block's norm and q, k, v base layers pass no gradient back (their inputs
    need none), every later module does; with full fine-tuning every module does."""
    lora = model_shape(LlamaConfig(**SHAPE), lora_r=4)
    flows = {u.name: u.grad_out for u in lora.units}
    quiet = {n for n, f in flows.items() if not f}
    assert quiet == {"model.embed_tokens", "model.layers.0.input_layernorm",
                     "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                     "model.layers.0.self_attn.v_proj"}  # fmt: skip
    full = model_shape(LlamaConfig(**SHAPE))
    assert all(u.grad_out for u in full.units)
    trace = training_trace(lora, checkpointing=False)
    backward = {lora.params[p.params[0]].name for p in trace if p.kind is Pass.BACKWARD}
    assert "model.layers.0.self_attn.q_proj.weight" not in backward
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in backward
    assert "model.layers.0.self_attn.o_proj.weight" in backward
