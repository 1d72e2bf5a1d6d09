"""`ResolvedConfig`: the config as a run uses it, what `resolve_run` returns.

Every component below this package reads a `ResolvedConfig` (or the section of one that it
is handed). It is frozen, and each field that may be "auto" in a loaded `Config` is narrowed
here to its number or flag, so no reader checks for "auto" or casts with `int(...)`. The
classes only narrow their base's fields: the key tables, parsing and emitting are the base's
(`parse` builds these from a resolved dict and refuses a leftover "auto" as a wrong type).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infinity.config.config import Config
from infinity.config.sections import (
    BF16Config,
    FP16Config,
    OffloadParamConfig,
    OptimizerConfig,
    ZeroConfig,
    section_of,
)
from infinity.config.values import AUTO


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What a run knows that its config does not, and that its "auto" values follow."""

    world_size: int = 1
    """Ranks in the run: train_batch_size counts every rank's micro batches."""
    param_numels: tuple[int, ...] | None = None
    """Elements of each of the model's parameters, as the engine builds them (LoRA adapters
    included): the staging buffers' size (`staging_numel`); None: DeepSpeed's 1e8."""
    resident: bool = False
    """Resolve as the engine runs the model and the estimate and the planner model it:
    stages 0-2 as stage 3 with every parameter of `param_numels` resident (see [Note:
    stages 0-2]); `param_numels` empty counts as one parameter of one element."""
    hidden_size: int | None = None
    """Sizes zero's buckets as the Hugging Face integration does; None: DeepSpeed's defaults
    (the engine, which is handed a module, knows no hidden size)."""
    total_num_steps: int | None = None
    """The run's optimizer steps: a schedule's "auto" total_num_steps (required then)."""
    warmup_num_steps: int | None = None
    """A schedule's "auto" warmup_num_steps; None: the schedule's default, capped at the
    total."""
    local_rank: int | None = None
    """This process's entry of a per-rank nvme_path list; None leaves a list whole."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class ResolvedOffloadParam(OffloadParamConfig):
    """`OffloadParamConfig` with its staging buffers sized."""

    buffer_size: int
    """Elements per staging buffer (see `infinity.config.resolve.staging_numel`)."""


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class ResolvedZero(ZeroConfig):
    """`ZeroConfig` with every size a number of elements."""

    offload_param: ResolvedOffloadParam
    max_live_parameters: int
    prefetch_bucket_size: int
    max_reuse_distance: int
    param_persistence_threshold: int
    sub_group_size: int
    reduce_bucket_size: int


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class ResolvedFP16(FP16Config):
    """`FP16Config` with `enabled` a flag."""

    enabled: bool


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class ResolvedBF16(BF16Config):
    """`BF16Config` with `enabled` a flag."""

    enabled: bool


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class ResolvedOptimizer(OptimizerConfig):
    """`OptimizerConfig` with its hyperparameters numbers."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class ResolvedConfig(Config):
    """The whole config with no "auto" left: the batch triple consistent for the run's ranks,
    zero's sizes and staging buffers set for its model, the schedule's run length known.
    `given_keys` is the record of the keys the user set, carried from the loaded `Config`.
    The scheduler's params are checked with no "auto" allowed. `aio.backend` may stay
    "auto": a choice made when the I/O engine starts, not a placeholder."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float
    fp16: ResolvedFP16
    bf16: ResolvedBF16
    optimizer: ResolvedOptimizer
    zero_optimization: ResolvedZero
    facts: RunFacts | None = field(
        default=None, compare=False, repr=False, metadata={"json": False}
    )
    """What `resolve_run` resolved it for (see `infinity.config.resolve.resolved_for`); not a
    JSON key."""


NARROWED: dict[type, type] = {
    OffloadParamConfig: ResolvedOffloadParam,
    ZeroConfig: ResolvedZero,
    FP16Config: ResolvedFP16,
    BF16Config: ResolvedBF16,
    OptimizerConfig: ResolvedOptimizer,
}
"""Each section with fields that may be "auto", and its resolved form."""


def check_resolved(section: Any, path: str) -> None:
    """Refuse a section that still holds "auto", naming the field and the fix. For the
    public builders that take one section (a loss scaler, an optimizer, a staging pool) and
    may be handed a loaded section rather than a `ResolvedConfig`'s; the engine's are
    always resolved."""
    narrowed = NARROWED.get(section_of(type(section)))
    if narrowed is None or isinstance(section, narrowed):
        return
    for name in narrowed.__annotations__:
        if getattr(section, name) == AUTO:
            raise ValueError(
                f"{path}.{name} is 'auto'; resolve the config first (infinity.config.resolve_run)"
            )
