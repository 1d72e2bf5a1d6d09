"""The parameters each LR schedule accepts (DeepSpeed's, and the transformers-style ones the
`infinity train` flags write), and their validation.

Checked when the config is loaded, so a bad schedule fails before training starts; the
schedules themselves live in `infinity.optim.schedules`.
"""

from __future__ import annotations

from typing import Any

from infinity.config.values import AUTO, suggest, to_float, to_int

WARMUP_TYPES = ("log", "linear")

# name -> (kind, default); kinds are checked by `check_scheduler_params`. `None` as a default
# means "required" except for warmup_max_lr, where it means "the optimizer's lr".
_WARMUP_PARAMS: dict[str, tuple[str, Any]] = {
    "warmup_min_lr": ("lr", 0.0),
    "warmup_max_lr": ("lr", None),
    "warmup_num_steps": ("steps", 1000),
    "warmup_type": ("warmup_type", "log"),
    "last_batch_iteration": ("iteration", -1),
}
SCHEDULER_PARAMS: dict[str, dict[str, tuple[str, Any]]] = {
    "WarmupLR": dict(_WARMUP_PARAMS),
    "WarmupDecayLR": {**_WARMUP_PARAMS, "total_num_steps": ("steps", None)},
    "WarmupCosineLR": {
        "total_num_steps": ("steps", None),
        "warmup_min_ratio": ("ratio", 0.0),
        "warmup_num_steps": ("steps", 1000),
        "cos_min_ratio": ("ratio", 0.0001),
        "warmup_type": ("warmup_type", "log"),
        "last_batch_iteration": ("iteration", -1),
    },
}
"""Every parameter each DeepSpeed schedule accepts, with DeepSpeed's defaults."""

# [Note: transformers-style schedules] "constant", "linear" and "cosine" follow
# `transformers.get_scheduler`'s constant_with_warmup, linear (warmup_stable_decay with a
# min_lr) and cosine (cosine_with_min_lr): a linear warmup from 0 over warmup_num_steps, then
# the decay to min_lr at total_num_steps. warmup_ratio instead of warmup_num_steps means
# ceil(warmup_ratio * total_num_steps), as the Trainer counts it. See infinity.optim.schedules.
_DECAY_PARAMS: dict[str, tuple[str, Any]] = {
    "total_num_steps": ("steps", None),
    "warmup_num_steps": ("count", 0),
    "warmup_ratio": ("ratio", None),
    "min_lr": ("lr", 0.0),
}
STEP_SCHEDULES: dict[str, dict[str, tuple[str, Any]]] = {
    "constant": {k: v for k, v in _DECAY_PARAMS.items() if k != "min_lr"},
    "linear": dict(_DECAY_PARAMS),
    "cosine": dict(_DECAY_PARAMS),
}
"""The transformers-style schedules (the names `infinity train --lr-schedule` takes)."""
SCHEDULER_PARAMS.update(STEP_SCHEDULES)


def check_scheduler_params(
    kind: str, params: Any, *, path: str = "scheduler.params", allow_auto: bool = True
) -> dict[str, Any]:
    """Validate one schedule's parameters; return them normalized (only those given).

    Numbers given as strings ("1e-4") are converted; "auto" is kept when `allow_auto`.
    Raises ValueError/TypeError naming `path.<param>`, the value and what is allowed.
    """
    spec = SCHEDULER_PARAMS[kind]
    if not isinstance(params, dict):
        raise TypeError(f"{path}: expected an object of parameters, got {params!r}")
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name not in spec:
            raise ValueError(
                f"{path}.{name}: unknown parameter for {kind}{suggest(name, spec)}; "
                f"allowed: {', '.join(sorted(spec))}"
            )
        if value == AUTO and name not in ("warmup_type", "last_batch_iteration"):
            if not allow_auto:
                raise ValueError(
                    f"{path}.{name}: 'auto' must be resolved first; call resolve_run()"
                )
            out[name] = AUTO
            continue
        out[name] = _check_schedule_value(spec[name][0], value, f"{path}.{name}")
    if "total_num_steps" in spec and "total_num_steps" not in out:
        raise ValueError(
            f"{path}.total_num_steps: required by {kind}; set it to the number of optimizer "
            f'steps of the run (or "auto" and pass it to resolve_run in RunFacts)'
        )
    if "warmup_ratio" in out and out.get("warmup_num_steps", AUTO) != AUTO:
        raise ValueError(
            f"{path}: warmup_num_steps ({out['warmup_num_steps']}) and warmup_ratio "
            f"({out['warmup_ratio']}) both set the warmup; give one"
        )
    total = out.get("total_num_steps")
    warmup = out.get("warmup_num_steps", spec["warmup_num_steps"][1])
    # A step schedule is checked when it is built (infinity.optim.schedules): `infinity train`
    # resolves its config with a placeholder run length before it knows the real one.
    step_schedule = kind in STEP_SCHEDULES
    if isinstance(total, int) and isinstance(warmup, int) and total < warmup and not step_schedule:
        default = "" if "warmup_num_steps" in out else ", the default"
        raise ValueError(
            f"{path}.total_num_steps: {total} is less than warmup_num_steps ({warmup}{default}); "
            f"the schedule would end inside its warmup: raise total_num_steps or lower "
            f"warmup_num_steps"
        )
    return out


def _check_schedule_value(kind: str, value: Any, path: str) -> Any:
    if kind == "warmup_type":
        if value not in WARMUP_TYPES:
            raise ValueError(f"{path}: {value!r} is not one of 'log', 'linear'")
        return value
    if kind in ("steps", "iteration", "count"):
        low = {"steps": 1, "count": 0, "iteration": -1}[kind]
        number = to_int(value, path)
        if number < low:
            raise ValueError(f"{path}: {number} is below the minimum {low}")
        return number
    number = to_float(value, path)
    if kind == "ratio" and not 0.0 <= number <= 1.0:
        raise ValueError(f"{path}: {number} is not a ratio in [0, 1]")
    if kind == "lr" and not number >= 0.0:
        raise ValueError(f"{path}: {number} is negative; a learning rate must be >= 0")
    return number
