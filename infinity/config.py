"""Typed configuration, read once and handed down section by section.

DeepSpeed's JSON key names (and its `stage3_` prefixes) are accepted here, at the edge, and
mapped onto these dataclasses; nothing below this module sees raw dicts. `AUTO` marks values
that are derived later from the model or the world size (see `Config.resolve`).
"""

from __future__ import annotations

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
