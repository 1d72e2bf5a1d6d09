"""The engine on the CPU device with gathers aliasing their host homes (the default) against
the same engine copying them, as on a GPU: bitwise the same losses and weights, the same live
budget, no bytes copied; aliases never stale across steps, skipped steps and checkpoint loads
(see [Note: gathered means resident] in infinity/zero/param.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import batches, config, tiny_gpt, train_steps

import infinity
from infinity.accelerator import CpuAccelerator

KEPT = 10**9  # a persistence threshold above every parameter: the model stays gathered

CASES = {
    "fp32": dict(zero={}, top={}),
    "fp32-kept-accum-clip": dict(
        zero={"stage3_param_persistence_threshold": KEPT},
        top={"gradient_accumulation_steps": 2, "gradient_clipping": 0.5},
    ),
    "fp32-small-budget": dict(
        zero={"stage3_max_live_parameters": 3000, "stage3_max_reuse_distance": 0}, top={}
    ),
    "bf16-kept": dict(
        zero={"stage3_param_persistence_threshold": KEPT}, top={"bf16": {"enabled": True}}
    ),
    # A loss scale of 2^40 overflows fp16 at once: the first steps are skipped.
    "fp16-kept-overflow": dict(
        zero={"stage3_param_persistence_threshold": KEPT},
        top={"fp16": {"enabled": True, "initial_scale_power": 40, "loss_scale_window": 2}},
    ),
}


def _engine(model, case: str, *, alias: bool):
    spec = CASES[case]
    cfg = config(**spec["zero"])
    cfg.update(copy.deepcopy(spec["top"]))
    accel = CpuAccelerator(alias_host=alias)
    return infinity.initialize(copy.deepcopy(model), cfg, accelerator=accel), accel


def _weights(engine) -> dict[str, torch.Tensor]:
    return {name: w.clone() for name, w in engine.named_parameters_host()}


@pytest.mark.parametrize("case", list(CASES))
def test_aliasing_changes_nothing_but_the_copies(case):
    torch.manual_seed(0)
    model = tiny_gpt(layers=2, hidden=32, checkpointing=case.endswith("clip"))
    data = batches(6, seed=4)
    runs = {}
    for alias in (True, False):
        engine, accel = _engine(model, case, alias=alias)
        losses = train_steps(engine, data)
        live = [r.param.detach().clone() for r in engine.parts.records if r.state.name == "LIVE"]
        homes = [
            r.read_full().view(r.shape) for r in engine.parts.records if r.state.name == "LIVE"
        ]
        runs[alias] = (losses, _weights(engine), engine.memory_stats(), engine.skipped_steps)
        # What is gathered after the last step is the home's current value, either way.
        assert all(torch.equal(a, b) for a, b in zip(live, homes, strict=True))
        if alias:
            assert accel.copies.host_to_device_bytes == 0
            assert all(r.aliased for r in engine.parts.records if r.state.name == "LIVE")
        else:
            assert accel.copies.host_to_device_bytes > 0
        engine.close()
    (l1, w1, s1, k1), (l2, w2, s2, k2) = runs[True], runs[False]
    assert l1 == l2  # bitwise
    assert w1.keys() == w2.keys() and all(torch.equal(w1[n], w2[n]) for n in w1)
    assert k1 == k2 and (k1 > 0) is case.endswith("overflow")
    for key in ("peak_live_param_numel", "live_param_numel", "budget_overruns"):
        assert s1[key] == s2[key], key


def test_checkpoint_load_reaches_live_aliases(tmp_path):
    """A load writes the homes under parameters kept gathered: training on from it gives
    what the uninterrupted run gave, even in an engine whose aliases were live with other
    weights when it loaded."""
    torch.manual_seed(0)
    model = tiny_gpt(layers=2, hidden=32, checkpointing=False)
    first, then, other = batches(2, seed=5), batches(3, seed=6), batches(2, seed=7)
    engine, _ = _engine(model, "fp32-kept-accum-clip", alias=True)
    train_steps(engine, first)
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = train_steps(engine, then)
    engine.close()
    resumed, _ = _engine(model, "fp32-kept-accum-clip", alias=True)
    train_steps(resumed, other)  # different weights, gathered (aliased) at the load
    assert any(r.aliased for r in resumed.parts.records)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert train_steps(resumed, then) == expected
    resumed.close()
