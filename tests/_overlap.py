"""Training runs of the overlapped-step tests: one config with `offload_optimizer.overlap_step`
on or off, everything a step leaves behind recorded bit for bit."""

from __future__ import annotations

import copy
import hashlib

import torch
from _engine_models import batches, config, tiny_gpt

import infinity
from infinity.models.lora import LoraSpec, apply_lora

STEPS = 4
CLIPS = {"off": 0.0, "loose": 1e6, "biting": 1e-3}
"""gradient_clipping: none, on but never reached (coefficient exactly 1), always reached."""


def overlap_config(
    *, dtype: str, clip: str, accum: int, tier: str, nvme_dir: str, overlap: bool
) -> dict:
    cfg = config(sub_group_size=2048)  # a sub-group per slot or two: many to step early
    # Off: today's serial step, fp32 gradient sums included; on: overlapped, and at
    # accumulation 1 in fp16/bf16 the gradients kept in 16 bits.
    offload = {"device": tier, "overlap_step": overlap, "half_gradients": overlap}
    if tier == "nvme":  # the gradient sums in RAM: only those are stepped early
        offload |= {"nvme_path": nvme_dir, "gradients_in_cpu": True}
    cfg["zero_optimization"]["offload_optimizer"] = offload
    cfg["gradient_accumulation_steps"] = accum
    cfg["gradient_clipping"] = CLIPS[clip]
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # 2^20 overflows the first steps: skips and a falling loss scale
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 20, "hysteresis": 1}
    return cfg


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()


def train(
    cfg: dict,
    *,
    comm=None,
    rank: int = 0,
    world: int = 1,
    accelerator=None,
    on_engine=None,
    lora_r: int = 0,
) -> dict:
    """STEPS optimizer steps of the tiny GPT on this rank's share of fixed batches: per step
    the loss, grad norm, loss scale and whether it was skipped; at the end digests of every
    weight and optimizer state tensor, and what was stepped early. `on_engine(engine)` is
    called once it is built; `lora_r` puts adapters (B drawn, not zero) on every linear layer
    of the blocks, the base frozen."""
    torch.manual_seed(0)
    model = tiny_gpt(checkpointing=False)
    if lora_r:
        model = apply_lora(model, LoraSpec(r=lora_r))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    kwargs = {} if comm is None else {"comm": comm}
    if accelerator is not None:
        kwargs["accelerator"] = accelerator
    engine = infinity.initialize(copy.deepcopy(model), cfg, **kwargs)
    if on_engine is not None:
        on_engine(engine)
    accum = engine.gradient_accumulation_steps
    data = batches(STEPS * accum, batch=2 * world, seq=8, seed=3)
    out: dict = {"losses": [], "norms": [], "scales": [], "skipped": [], "ahead": []}
    try:
        for i in range(0, len(data), accum):
            for ids in data[i : i + accum]:
                mine = ids[2 * rank : 2 * rank + 2]
                loss = engine(mine, mine)
                engine.backward(loss)
                assert engine.parts.optimizer.wait_ahead()  # what can go early has gone
                out["losses"].append(loss.item())
                engine.step()
            out["norms"].append(engine.get_global_grad_norm())
            out["scales"].append(engine.loss_scale)
            out["skipped"].append(engine.was_step_skipped)
            t = engine.parts.optimizer.last_timings
            out["ahead"].append([t.get("ahead_sub_groups", 0), t.get("ahead_confirmed", 0)])
        out["weights"] = {n: digest(w) for n, w in engine.named_parameters_host()}
        out["state"] = {n: digest(read()) for n, read in engine.parts.optimizer.state_tensors()}
    finally:
        engine.close()
    return out


def same_bits(a: dict, b: dict) -> None:
    """Everything but what was stepped early is the same, bit for bit (floats compared
    by repr: NaN and inf included)."""
    for key in ("losses", "norms", "scales", "skipped"):
        assert [repr(x) for x in a[key]] == [repr(x) for x in b[key]], key
    assert a["weights"] == b["weights"]
    assert a["state"] == b["state"]
