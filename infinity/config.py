"""Typed configuration, read once and handed down section by section.

DeepSpeed's JSON key names (and its `stage3_` prefixes) are accepted here, at the edge, and
mapped onto these dataclasses; nothing below this module sees raw dicts. `AUTO` marks values
that are derived later from the model or the world size (see `Config.resolve`).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal

AUTO = "auto"

OffloadDevice = Literal["none", "cpu", "nvme"]


@dataclass(kw_only=True, slots=True)
class OffloadParamConfig:
    """Where the half-precision parameter partitions live between uses."""

    device: OffloadDevice = "cpu"
    """"cpu" (pinned host RAM when CUDA is present), "nvme", or "none" (stay on the device)."""
    pin_memory: bool = True
    """Pin host buffers so device copies are asynchronous (ignored without CUDA)."""
    nvme_path: str | None = None
    """Directory on a fast SSD for the swap store; required when device is "nvme"."""
    buffer_count: int = 5
    """Number of pinned staging buffers for NVMe parameter reads."""
    buffer_size: int | str = AUTO
    """Elements per staging buffer; "auto" = at least the largest parameter."""


@dataclass(kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """Where fp32 master weights and Adam moments live."""

    device: OffloadDevice = "cpu"
    """"cpu" (host RAM) or "nvme"; "none" is accepted and treated as "cpu" for stage 3."""
    pin_memory: bool = True
    """Pin the host buffers used for optimizer swapping."""
    nvme_path: str | None = None
    """Directory on a fast SSD for the optimizer swap store; required when device is "nvme"."""
    buffer_count: int = 4
    """Sub-groups in flight in the NVMe optimizer pipeline (read, step, write)."""


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """ZeRO stage-3 partitioning, prefetch and budget settings."""

    stage: int = 3
    """Only stage 3 is supported."""
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    max_live_parameters: int | str = 1_000_000_000
    """Hard bound on gathered elements on the device at any moment (plus the largest module)."""
    prefetch_bucket_size: int | str = 50_000_000
    """Elements fetched ahead of use along the traced execution order."""
    max_reuse_distance: int | str = 1_000_000_000
    """A parameter reused within this many elements of later gathers is kept, not released."""
    param_persistence_threshold: int | str = 100_000
    """Parameters with fewer elements stay resident on the device."""
    sub_group_size: int = 1_000_000_000
    """Elements per optimizer sub-group (the unit of CPU-Adam and NVMe swapping)."""


@dataclass(kw_only=True, slots=True)
class FP16Config:
    """fp16 mixed precision with dynamic (or static) loss scaling."""

    enabled: bool | str = False
    loss_scale: float = 0.0
    """0 means dynamic loss scaling; any other value is a static scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved."""
    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every step without overflow (not only after a good window)."""
    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to fp16."""


@dataclass(kw_only=True, slots=True)
class BF16Config:
    """bf16 mixed precision (no loss scaling needed)."""

    enabled: bool | str = False


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer, run by CPU-Adam on the fp32 master weights."""

    type: Literal["Adam", "AdamW"] = "AdamW"
    lr: float | str = 1e-3
    betas: tuple[float, float] | str = (0.9, 0.999)
    eps: float | str = 1e-8
    weight_decay: float | str = 0.0
    bias_correction: bool = True


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """A learning-rate schedule, DeepSpeed names and parameters."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed's parameters for `type` (see `SCHEDULER_PARAMS`); missing ones take defaults."""


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
"""Every parameter each schedule accepts, with DeepSpeed's defaults."""


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
                f"{path}.{name}: unknown parameter for {kind}{_suggest(name, spec)}; "
                f"allowed: {', '.join(sorted(spec))}"
            )
        if value == AUTO and name not in ("warmup_type", "last_batch_iteration"):
            if not allow_auto:
                raise ValueError(
                    f"{path}.{name}: 'auto' must be resolved first; call Config.resolve()"
                )
            out[name] = AUTO
            continue
        out[name] = _check_schedule_value(spec[name][0], value, f"{path}.{name}")
    warmup, total = (
        out.get("warmup_num_steps", spec["warmup_num_steps"][1]),
        out.get("total_num_steps"),
    )
    if isinstance(total, int) and isinstance(warmup, int) and total < warmup:
        raise ValueError(
            f"{path}.total_num_steps: {total} is less than warmup_num_steps ({warmup}); "
            f"the schedule would end inside its warmup: raise total_num_steps or lower "
            f"warmup_num_steps"
        )
    return out


def _check_schedule_value(kind: str, value: Any, path: str) -> Any:
    if kind == "warmup_type":
        if value not in WARMUP_TYPES:
            raise ValueError(f"{path}: {value!r} is not one of 'log', 'linear'")
        return value
    if kind in ("steps", "iteration"):
        low = 1 if kind == "steps" else -1
        number = _to_int(value, path)
        if number < low:
            raise ValueError(f"{path}: {number} is below the minimum {low}")
        return number
    number = _to_float(value, path)
    if kind == "ratio" and not 0.0 <= number <= 1.0:
        raise ValueError(f"{path}: {number} is not a ratio in [0, 1]")
    if kind == "lr" and not number >= 0.0:
        raise ValueError(f"{path}: {number} is negative; a learning rate must be >= 0")
    return number


def _suggest(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _to_float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{path}: expected a number, got {value!r} ({type(value).__name__})")
    try:
        number = float(value)
    except ValueError:
        raise TypeError(f"{path}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{path}: {value!r} is not finite; give a finite number")
    return number


def _to_int(value: Any, path: str) -> int:
    """An integer; integral floats (1e7, JSON's 5e8) and numeric strings ("1e5") are accepted."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = _to_float(value, path)
    if number != int(number):
        raise TypeError(f"{path}: expected an integer, got {value!r}")
    return int(number)


@dataclass(kw_only=True, slots=True)
class AioConfig:
    """Async I/O settings for every NVMe transfer."""

    block_size: int = 1 << 20
    """Bytes per I/O request."""
    queue_depth: int = 32
    """Requests in flight per worker thread."""
    thread_count: int = 1
    """Worker threads (DeepSpeed: intra_op_parallelism)."""
    single_submit: bool = False
    """Submit requests one at a time rather than in batches."""
    overlap_events: bool = True
    """Reap completions while submitting (keeps the queue full)."""
    backend: str = "auto"
    """"auto", "io_uring", "aio" or "posix"."""


@dataclass(kw_only=True, slots=True)
class Config:
    """The whole run configuration. Build it with `Config.load(path_or_dict)`."""

    train_batch_size: int | str = AUTO
    train_micro_batch_size_per_gpu: int | str = AUTO
    gradient_accumulation_steps: int | str = AUTO
    gradient_clipping: float | str = 0.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    seed: int = 1234
    steps_per_print: int = 10
