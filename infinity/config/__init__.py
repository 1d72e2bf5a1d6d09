"""Typed configuration, read once and handed down section by section.

DeepSpeed's JSON key names (and its `stage3_` prefixes) are accepted here, at the edge, and
mapped onto these dataclasses; nothing below this package sees raw dicts. In a loaded `Config`,
`AUTO` marks values derived later from the model or the world size; `resolve_run` (the one
resolving function) turns it and the run's facts into the frozen `ResolvedConfig` that
everything below this package reads.
"""

from infinity.config.config import Config
from infinity.config.resolve import resolve_run, resolved_for
from infinity.config.resolved import (
    ResolvedConfig,
    ResolvedFP16,
    ResolvedOffloadParam,
    ResolvedOptimizer,
    ResolvedZero,
    RunFacts,
    check_resolved,
)
from infinity.config.scheduler_params import (
    SCHEDULER_PARAMS,
    STEP_SCHEDULES,
    WARMUP_TYPES,
    check_scheduler_params,
)
from infinity.config.sections import (
    AioConfig,
    BF16Config,
    FP16Config,
    OffloadDevice,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from infinity.config.values import AUTO, leave_open, left_open

__all__ = [
    "AUTO",
    "SCHEDULER_PARAMS",
    "STEP_SCHEDULES",
    "WARMUP_TYPES",
    "AioConfig",
    "BF16Config",
    "Config",
    "FP16Config",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ResolvedConfig",
    "ResolvedFP16",
    "ResolvedOffloadParam",
    "ResolvedOptimizer",
    "ResolvedZero",
    "RunFacts",
    "SchedulerConfig",
    "ZeroConfig",
    "check_resolved",
    "check_scheduler_params",
    "leave_open",
    "left_open",
    "resolve_run",
    "resolved_for",
]
