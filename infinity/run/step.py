"""The pieces of one `infinity train` step: its loss, its line in metrics.jsonl, and the
--profile window around the steps.

Owns what a step computes and records; the loop that runs the steps, saves and stops is
`infinity.run.training`'s.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from infinity.utils.profiler import StepProfiler

# The step before a profile's: it traces the execution order and fills caches.
PROFILE_WARMUP_STEPS = 1


def model_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> dict:
    """The model's keyword arguments for a batch: with packed examples their position ids
    (each example's restart at 0, which transformers' attention masks also read to keep the
    examples apart; no KV cache, which would stop it from doing so)."""
    if position_ids is None:
        return {"input_ids": input_ids}
    return {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32. `labels` are already shifted by the data pipeline
    (labels[t] follows input_ids[t]), so the model's own loss, which shifts, is not used."""
    labels = labels.to(logits.device)  # batches come from the CPU; logits from the device
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def step_record(engine, loss: float, lr: float, tokens_per_s: float, seconds: float) -> dict:
    """The step's line in metrics.jsonl: the loop's figures, then the engine's telemetry
    (names in docs/telemetry.md)."""
    record = {
        "step": engine.global_steps,
        "loss": loss,
        "lr": lr,
        "grad_norm": engine.get_global_grad_norm(),
        "step_s": seconds,
        "tokens_per_s": tokens_per_s,
    }
    record.update(engine.last_step_telemetry().to_dict())
    if engine.config.precision == "fp16":
        record["loss_scale"] = engine.loss_scale
        record["skipped"] = engine.was_step_skipped
    return record


def start_profile(engine, wanted: int | None, steps: int, save_dir: Path) -> StepProfiler | None:
    """With --profile `wanted`: that many steps after a warm-up step, or as many as the run
    has left of its `steps`; the trace goes to save_dir/profile."""
    if not wanted:
        return None
    left = steps - engine.global_steps
    warmup = min(PROFILE_WARMUP_STEPS, max(0, left - wanted))
    if left < wanted + PROFILE_WARMUP_STEPS:
        print(
            f"--profile {wanted}: the run has {left} step(s) left; profiling "
            f"{min(wanted, left)} after {warmup} warm-up step(s)"
        )
    return engine.profile(min(wanted, left), save_dir / "profile", warmup_steps=warmup)


def end_profile(profiler: StepProfiler) -> None:
    """Write what was recorded (a stop may come before the profile's last step)."""
    profiler.stop()
    if profiler.path is None and profiler.error is None:
        print("--profile: the run ended in the warm-up step; no trace was written")
    else:
        print(profile_written(profiler))


def profile_written(profiler: StepProfiler) -> str:
    """The line that says where the trace went, or why there is none."""
    if profiler.recorded is None:
        return f"--profile: {profiler.error}; training went on without the trace"
    first, last = profiler.recorded
    return f"--profile: steps {first}-{last} written to {profiler.path} (Chrome trace)"
