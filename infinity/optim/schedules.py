"""Learning-rate schedules: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, plus constant,
and the transformers-style constant, linear and cosine that `infinity train --lr-schedule` sets.

A schedule is a pure function of how many optimizer steps have been applied; it does not touch
an optimizer. The engine asks `lr_at(step)` before each optimizer step. Parameters are checked
by `infinity.config.check_scheduler_params`, so a config error surfaces at load time.

[Note: step indexing] `lr_at(step)` takes `step` = the number of optimizer steps already
applied (0 for the very first step). DeepSpeed builds its scheduler with
`last_batch_iteration=-1`, which sets the optimizer's lr for the first step, and calls
`scheduler.step()` after every applied step (not after steps skipped on fp16 overflow). So the
lr of applied step number `step` is DeepSpeed's `get_lr()` at
`last_batch_iteration = step - 1`. Consequences kept on purpose, to match DeepSpeed: the first
step of WarmupLR/WarmupDecayLR uses `warmup_min_lr` and so does the second (log(1) = 0 and
0 / warmup are both 0); the first step of WarmupCosineLR uses lr 0. Steps skipped on overflow
must not be counted in `step`. A `last_batch_iteration` parameter k shifts the whole schedule:
step s uses DeepSpeed's iteration k + s (DeepSpeed itself leaves the optimizer's lr in place
for the first step when k != -1).

[Note: transformers-style step indexing] "constant", "linear" and "cosine" give, for applied
step `step`, the lr `transformers.get_scheduler` (constant_with_warmup, linear or
warmup_stable_decay with min_lr_ratio, cosine or cosine_with_min_lr) sets for the same step:
base_lr * step / warmup while step < warmup (so the first step's lr is 0 when there is a
warmup); then constant at base_lr, or decaying to min_lr at total_num_steps (linear:
min_lr + (base_lr - min_lr) * (total - step) / (total - warmup); cosine: the same with a half
cosine). Past total_num_steps the lr stays at min_lr (transformers' cosine would rise again).
The warmup starts from 0 with a min_lr too, as cosine_with_min_lr's does (warmup_stable_decay,
transformers' linear decay to a min_lr, starts its warmup from min_lr instead).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from infinity.config import (
    SCHEDULER_PARAMS,
    STEP_SCHEDULES,
    SchedulerConfig,
    check_scheduler_params,
)

logger = logging.getLogger(__name__)

__all__ = ["Schedule", "build_schedule"]


class Schedule:
    """The lr as a function of applied optimizer steps, with an optional step counter.

    `lr_at(step)` is pure. For callers that prefer state, `step()` advances `steps` (applied
    optimizer steps) and `lr` is `lr_at(steps)`; `state_dict()` saves that counter.
    """

    def __init__(self, kind: str | None, params: dict[str, Any], base_lr: float) -> None:
        self.kind = kind
        self.params = dict(params)
        self.base_lr = float(base_lr)
        self.steps = 0
        self._offset = -1  # DeepSpeed's last_batch_iteration before the first step
        p = self.params
        if kind is None:
            return
        if kind in STEP_SCHEDULES:
            self._init_step_schedule()
            return
        # DeepSpeed raises a warmup shorter than 2 to 2 (a log warmup needs log(W) > 0).
        self._warmup = max(2, int(p["warmup_num_steps"]))
        self._log_scale = 1.0 / math.log(self._warmup)
        self._offset = int(p["last_batch_iteration"])
        if kind in ("WarmupLR", "WarmupDecayLR"):
            self._min_lr = float(p["warmup_min_lr"])
            max_lr = p["warmup_max_lr"]
            self._max_lr = self.base_lr if max_lr is None else float(max_lr)

    def lr_at(self, step: int) -> float:
        """The lr for the optimizer step taken after `step` applied steps (see the module note)."""
        if step < 0:
            raise ValueError(f"lr_at: step must be >= 0 (applied optimizer steps), got {step}")
        if self.kind is None:
            return self.base_lr
        if self.kind in STEP_SCHEDULES:
            return self._step_schedule_lr(step)
        iteration = self._offset + step  # DeepSpeed's last_batch_iteration
        if self.kind == "WarmupCosineLR":
            return 0.0 if iteration < 0 else self.base_lr * self._cosine_ratio(iteration)
        if iteration < 0:
            return self._min_lr
        return self._min_lr + (self._max_lr - self._min_lr) * self._gamma(iteration)

    @property
    def lr(self) -> float:
        """The lr for the next optimizer step, by the internal counter."""
        return self.lr_at(self.steps)

    def step(self) -> None:
        """Count one applied optimizer step (do not call for steps skipped on overflow)."""
        self.steps += 1

    @property
    def iteration(self) -> int:
        """DeepSpeed's `last_batch_iteration`: applied steps plus the schedule's
        `last_batch_iteration` parameter (-1 by default), or applied steps - 1 for the
        schedules DeepSpeed does not have."""
        return self._offset + self.steps

    def _init_step_schedule(self) -> None:
        p = self.params
        total = int(p["total_num_steps"])
        ratio = p.get("warmup_ratio")
        # As the Trainer's get_warmup_steps: a ratio of the run, rounded up.
        self._warmup = math.ceil(ratio * total) if ratio is not None else int(p["warmup_num_steps"])
        if self._warmup > total:
            raise ValueError(
                f"scheduler.params: the warmup ({self._warmup} steps) is longer than the run "
                f"(total_num_steps {total}); lower --warmup-steps or --warmup-ratio, or train "
                "for more steps"
            )
        min_lr = float(p.get("min_lr", 0.0))
        if min_lr > self.base_lr:
            raise ValueError(
                f"scheduler.params.min_lr ({min_lr}) is above the lr ({self.base_lr}): the "
                f"{self.kind} schedule decays from the lr down to min_lr; lower --min-lr"
            )
        self._min_ratio = min_lr / self.base_lr if self.base_lr > 0 else 0.0

    def _step_schedule_lr(self, step: int) -> float:
        """[Note: transformers-style step indexing]; the factor is computed as transformers
        does, so the rates agree to the last bit or nearly."""
        warmup, total = self._warmup, int(self.params["total_num_steps"])
        if step < warmup:
            return self.base_lr * (float(step) / float(max(1, warmup)))
        if self.kind == "constant":
            return self.base_lr
        progress = min(1.0, float(step - warmup) / float(max(1, total - warmup)))
        if self.kind == "linear":
            factor = max(0.0, float(total - step) / float(max(1, total - warmup)))
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        factor = factor * (1 - self._min_ratio) + self._min_ratio
        return self.base_lr * max(0.0, factor)

    def _warmup_fraction(self, iteration: int) -> float:
        if self.params["warmup_type"] == "log":
            return self._log_scale * math.log(iteration + 1)
        return iteration / self._warmup

    def _gamma(self, iteration: int) -> float:
        if iteration < self._warmup:
            return self._warmup_fraction(iteration)
        if self.kind == "WarmupLR":
            return 1.0
        total = int(self.params["total_num_steps"])
        return max(0.0, (total - iteration) / max(1.0, total - self._warmup))

    def _cosine_ratio(self, iteration: int) -> float:
        p = self.params
        if iteration < self._warmup:
            low = float(p["warmup_min_ratio"])
            return low + (1.0 - low) * self._warmup_fraction(iteration)
        decay_steps = max(1, int(p["total_num_steps"]) - self._warmup)
        # Clamped at 1 so the lr stays at the floor past total_num_steps (no rise back up).
        progress = min(1.0, (iteration - self._warmup + 1) / decay_steps)
        floor = float(p["cos_min_ratio"])
        return max(0.0, floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the counter plus what the schedule was built from (for checking)."""
        return {
            "type": self.kind,
            "params": dict(self.params),
            "base_lr": self.base_lr,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counter. The configured schedule wins over a saved one that differs."""
        if not isinstance(state, dict) or "steps" not in state:
            raise ValueError(
                f"Schedule.load_state_dict: expected a dict with 'steps', got {state!r}"
            )
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(
                f"Schedule.load_state_dict: 'steps' must be an int >= 0, got {steps!r}"
            )
        saved = (state.get("type"), state.get("params"), state.get("base_lr"))
        if saved != (self.kind, self.params, self.base_lr):
            logger.warning(
                "resuming with a schedule that differs from the checkpoint's (%r, %r, lr %r); "
                "using the configured one (%r, %r, lr %r)",
                *saved,
                self.kind,
                self.params,
                self.base_lr,
            )
        self.steps = steps


def build_schedule(cfg: SchedulerConfig, base_lr: float) -> Schedule:
    """Build the schedule `cfg` describes; constant at `base_lr` when `cfg.type` is None.

    `base_lr` is the optimizer's lr: WarmupCosineLR scales it, and WarmupLR/WarmupDecayLR use it
    when warmup_max_lr is not given (DeepSpeed's WarmupDecayLR would use 0.001 there instead).
    """
    if isinstance(base_lr, bool) or not isinstance(base_lr, (int, float)) or base_lr < 0:
        raise ValueError(
            f"build_schedule: base_lr must be a number >= 0, got {base_lr!r} "
            f"(resolve_run replaces an 'auto' lr)"
        )
    if cfg.type is None:
        if cfg.params:
            raise ValueError(
                f"scheduler.params given without scheduler.type: {cfg.params!r}; set "
                f"scheduler.type to one of {', '.join(SCHEDULER_PARAMS)} or drop the params"
            )
        return Schedule(None, {}, base_lr)
    if cfg.type not in SCHEDULER_PARAMS:
        raise ValueError(
            f"scheduler.type: {cfg.type!r} is not one of {', '.join(map(repr, SCHEDULER_PARAMS))}"
        )
    given = check_scheduler_params(cfg.type, cfg.params, allow_auto=False)
    spec = SCHEDULER_PARAMS[cfg.type]
    params = {name: given.get(name, default) for name, (_, default) in spec.items()}
    if "total_num_steps" in spec and params["total_num_steps"] is None:
        raise ValueError(
            f"scheduler.params.total_num_steps: required by {cfg.type}; set it to the number "
            f"of optimizer steps of the run"
        )
    return Schedule(cfg.type, params, base_lr)


def step_lrs(schedule: Any) -> tuple[float, ...]:
    """The lrs of the next step: the schedule's `lrs` (one per parameter group) when it has
    them, else its one `lr`."""
    lrs = getattr(schedule, "lrs", None)
    return tuple(float(x) for x in lrs) if lrs is not None else (float(schedule.lr),)
