"""`resolve_run`: the one place a loaded config is resolved, for the facts of a run
(`RunFacts`), into a frozen `ResolvedConfig` with every "auto" replaced by a number, as
DeepSpeed and its Hugging Face integration do."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from infinity.config.keys import KEYS
from infinity.config.parse import emit, parse
from infinity.config.resolved import ResolvedConfig, RunFacts
from infinity.config.scheduler_params import SCHEDULER_PARAMS, check_scheduler_params
from infinity.config.sections import ConfigFields, SchedulerConfig, ZeroConfig
from infinity.config.values import AUTO

logger = logging.getLogger(__name__)


def resolve_run(config: ConfigFields, facts: RunFacts) -> ResolvedConfig:
    """`config` resolved for a run with these `facts`; `config` is unchanged.

    The batch triple is made consistent (train = micro * accumulation * world_size; any two
    determine the third; one alone: accumulation 1; none: micro 1 and accumulation 1).
    With `hidden_size`, zero sizes follow the Hugging Face integration (prefetch 0.9*h*h,
    persistence threshold 10*h, reduce bucket h*h). Scheduler "auto"s: warmup_min_lr 0,
    warmup_max_lr the optimizer's lr, warmup_num_steps `warmup_num_steps` (else the
    schedule's default, capped at the total), total_num_steps `total_num_steps` (required if
    "auto"). `param_numels` size offload_param.buffer_size (`staging_numel`; else 1e8,
    DeepSpeed's default). Everything else takes its default. With `resident`, as the engine
    runs it: the engine, the estimate and the planner resolve through this function only,
    so what the estimate prints is what the engine does."""
    numels = facts.param_numels
    if facts.resident:  # a parameter of no elements still takes a staging slot
        numels = tuple(max(1, n) for n in numels or ()) or (1,)
    _check_facts(facts, numels)
    if facts.resident and config.zero_optimization.stage < 3:
        _warn_stage3_only(config.zero_optimization)
        config = resident(config, numels)
    default = ConfigFields()
    train, micro, accum = _resolve_batch(config, facts.world_size)
    optimizer = _filled(config.optimizer, default.optimizer, ("lr", "betas", "eps", "weight_decay"))
    out = replace(
        _filled(config, default, ("gradient_clipping",)),
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accum,
        fp16=_filled(config.fp16, default.fp16, ("enabled",)),
        bf16=_filled(config.bf16, default.bf16, ("enabled",)),
        optimizer=optimizer,
        zero_optimization=_resolve_zero(config.zero_optimization, facts.hidden_size, numels),
        scheduler=_resolve_scheduler(
            config.scheduler, optimizer.lr, facts.total_num_steps, facts.warmup_num_steps
        ),
    )
    check_communication_dtype(out)  # the precision settled
    # Parsed as the narrowed types: a value left "auto" would be refused here, by type.
    resolved = replace(
        parse(ResolvedConfig, emit(out), ""), given_keys=config.given_keys, facts=facts
    )
    return resolved if facts.local_rank is None else resolved.for_local_rank(facts.local_rank)


def resolved_for(config: Any, facts: RunFacts) -> bool:
    """True when `config` is a `ResolvedConfig` that `resolve_run` made for the ranks,
    parameter sizes, residency and local rank of `facts`: resolving it again for `facts`
    would give it back (its "auto"s are numbers already; the hidden size and the run's
    length only ever fill an "auto"), so a caller handed one takes it as it is."""
    made = getattr(config, "facts", None) if isinstance(config, ResolvedConfig) else None
    return made is not None and all(
        getattr(made, name) == getattr(facts, name) for name in BUILT_FROM
    )


BUILT_FROM = ("world_size", "param_numels", "resident", "local_rank")
"""The `RunFacts` fields a resolved config's numbers depend on once no "auto" is left."""


def _check_facts(facts: RunFacts, numels: Sequence[int] | None) -> None:
    given = dict(
        world_size=facts.world_size,
        hidden_size=facts.hidden_size,
        total_num_steps=facts.total_num_steps,
        warmup_num_steps=facts.warmup_num_steps,
    )
    given.update({f"param_numels[{i}]": n for i, n in enumerate(numels or ())})
    for name, value in given.items():
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"resolve_run: {name} must be a positive integer, got {value!r}")


# [Note: stages 0-2] ZeRO stages 0, 1 and 2 keep every parameter whole on each rank's
# device; 1 partitions the optimizer state and 2 the gradients too. Here they run through
# the stage-3 engine with every parameter persistent: gathered at the first forward, never
# released, refreshed by each optimizer step. On one rank that is exactly stage 2 with
# offload_optimizer (ZeRO-Offload): the parameters on the device, the fp32 gradient sums and
# the optimizer state where offload_optimizer puts them. On several ranks each rank still
# keeps only its shard of the gradient sums and the optimizer state (reduce-scattered, as
# stage 2 does; stages 0 and 1 would all-reduce and, at 0, keep the whole state on every
# rank), and its shard of the 16-bit weights in host memory besides the resident copy. The
# numbers are stage 3's, bit for bit: only where tensors live differs (docs/deepspeed.md).


STAGE3_ONLY = (
    "max_live_parameters",
    "prefetch_bucket_size",
    "max_reuse_distance",
    "param_persistence_threshold",
    "keep_weights_numel",
)
"""ZeroConfig fields that tune the gathers of partitioned parameters (stage 3 only)."""


def _warn_stage3_only(zero: ZeroConfig) -> None:
    default = ZeroConfig()
    for name in STAGE3_ONLY:
        if getattr(zero, name) != getattr(default, name):
            logger.warning(
                "zero_optimization.%s: ignored at stage %d, where every parameter stays on "
                "the device (it tunes stage 3's gathers)",
                KEYS[ZeroConfig].get(name, (name,))[0],
                zero.stage,
            )


def resident(cfg: ConfigFields, param_numels: Sequence[int]) -> ConfigFields:
    """A copy of `cfg` whose live budget and persistence threshold keep every parameter of
    `param_numels` elements gathered between iterations (`infinity.zero.build.persistent_flags`)."""
    zero = replace(
        cfg.zero_optimization,
        max_live_parameters=max(1, sum(param_numels)),
        param_persistence_threshold=max(param_numels, default=0) + 1,
    )
    return replace(cfg, zero_optimization=zero)


OUTLIER_RATIO = 4
"""An outlier parameter is over this many times every ordinary one."""
OUTLIERS_MAX = 2
"""At most this many outliers (an embedding and an untied output layer), which share one
staging buffer; with more, every buffer holds the largest parameter."""
OUTLIER_MIN_NUMEL = 1 << 22
"""An outlier has at least this many elements (8 MiB in 16 bits): below, buffers of the
largest cost little, and smaller ones would only shorten the prefetch a small model's
buffers hold."""


def staging_numel(numels: Sequence[int]) -> int:
    """Elements per NVMe staging buffer for parameters of `numels` elements: the largest
    parameter of at most 1/OUTLIER_RATIO of the largest when at most OUTLIERS_MAX are above
    that and the largest has OUTLIER_MIN_NUMEL elements or more, else the largest (see
    [Note: an outlier's own buffer] in infinity/swap/pool.py)."""
    largest = max(numels, default=1)
    ordinary = [n for n in numels if n * OUTLIER_RATIO <= largest]
    few = len(numels) - len(ordinary) <= OUTLIERS_MAX
    if not ordinary or not few or largest < OUTLIER_MIN_NUMEL:
        return largest
    return max(ordinary)


# Why each 16-bit communication dtype other than the training dtype is refused, by
# (communication dtype, training dtype): each would round or overflow what the training
# dtype's own reduction keeps, and none is a bandwidth choice worth that here.
_COMM_REFUSED = {
    ("fp16", "bf16"): "bf16 gradients can exceed fp16's range (65504) and a bf16 run has no "
    "loss scale to skip the step it overflows",
    ("bf16", "fp16"): "bf16 keeps 8 significant bits, fewer than the fp16 gradients' 11, so "
    "the sums would lose precision the fp16 reduction keeps",
    ("fp16", "fp32"): "the fp32 gradients would be rounded to 16 bits, and with no loss scale "
    "small ones lost and large ones overflowed",
    ("bf16", "fp32"): "the fp32 gradients would be rounded to 8 significant bits before they "
    "are summed",
}


def check_communication_dtype(cfg: ConfigFields) -> None:
    """Refuse a communication_data_type that is not null, "fp32" or the training dtype.
    Checked on the run's whole config (`resolve_run`, and early where `check_batch` is), not
    when a file is parsed: flags may set the precision after it (`infinity train --dtype`).
    An "auto" precision passes here until `resolve_run` has settled it."""
    comm = cfg.communication_data_type
    if comm in (None, "fp32") or AUTO in (cfg.fp16.enabled, cfg.bf16.enabled):
        return
    training = cfg.precision
    why = _COMM_REFUSED.get((comm, training))
    if why is not None:
        fix = "remove it" if training == "fp32" else f"remove it (the training dtype, {training})"
        raise ValueError(
            f"communication_data_type: {comm!r} is not supported when training in {training}: "
            f"{why}; {fix} or set it to 'fp32'"
        )


def check_batch(cfg: ConfigFields, world_size: int = 1) -> None:
    """Raise the ValueError `resolve_run` would raise for an inconsistent train_batch_size,
    train_micro_batch_size_per_gpu and gradient_accumulation_steps, without resolving."""
    _resolve_batch(cfg, world_size)


def batch_sizes(cfg: ConfigFields, world_size: int = 1) -> tuple[int, int, int]:
    """(train_batch_size, micro batch, accumulation) as `resolve_run` sets them for
    `world_size` ranks, without resolving the rest: a run counts its steps from them before
    it resolves its config once, with that run length."""
    return _resolve_batch(cfg, world_size)


def _resolve_zero(zero: ZeroConfig, hidden: int | None, numels: Sequence[int] | None) -> ZeroConfig:
    sizes = {}
    if hidden is not None:  # the Hugging Face integration's sizes
        sizes = dict(
            prefetch_bucket_size=int(0.9 * hidden * hidden),
            param_persistence_threshold=10 * hidden,
            reduce_bucket_size=hidden * hidden,
        )
    zero = replace(zero, **{k: v for k, v in sizes.items() if getattr(zero, k) == AUTO})
    names = ("max_live_parameters", "prefetch_bucket_size", "max_reuse_distance")
    names += ("param_persistence_threshold", "sub_group_size", "reduce_bucket_size")
    zero = _filled(zero, ZeroConfig(), names)
    offload = zero.offload_param
    if offload.buffer_size == AUTO:
        # DeepSpeed's default is 1e8; with the model's sizes, see `staging_numel`.
        size = staging_numel(numels) if numels else 10**8
        zero = replace(zero, offload_param=replace(offload, buffer_size=size))
    return zero


def _filled(section: Any, default: Any, names: tuple[str, ...]) -> Any:
    """`section` with each field of `names` that is "auto" taken from `default`."""
    auto = {n: getattr(default, n) for n in names if getattr(section, n) == AUTO}
    return replace(section, **auto) if auto else section


def _resolve_batch(cfg: ConfigFields, world: int) -> tuple[int, int, int]:
    """The consistent (train_batch_size, micro batch, accumulation) for `world` ranks."""
    train, micro, accum = (
        None if v == AUTO else v
        for v in (
            cfg.train_batch_size,
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
        )
    )
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world:
            raise ValueError(
                f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) "
                f"* gradient_accumulation_steps ({accum}) * world_size ({world}) = "
                f'{micro * accum * world}; change one of them or set one to "auto"'
            )
    elif train is not None:
        if micro is None and accum is None:
            accum = 1
        known, name = (
            (micro, "train_micro_batch_size_per_gpu")
            if micro
            else (accum, "gradient_accumulation_steps")
        )
        if train % (known * world):
            raise ValueError(
                f"train_batch_size ({train}) is not divisible by {name} ({known}) * world_size "
                f"({world}) = {known * world}; change one of them so it divides"
            )
        if micro is None:
            micro = train // (accum * world)
        else:
            accum = train // (micro * world)
    else:
        micro, accum = micro or 1, accum or 1
        train = micro * accum * world
    return train, micro, accum


def _resolve_scheduler(
    sched: SchedulerConfig, lr: float, total: int | None, warmup: int | None
) -> SchedulerConfig:
    if sched.type is None:
        return sched
    params = dict(sched.params)
    if params.get("total_num_steps") == AUTO:
        if total is None:
            raise ValueError(
                "scheduler.params.total_num_steps: 'auto' needs the run length; pass "
                "RunFacts(total_num_steps=...) to resolve_run or set it in the config"
            )
        params["total_num_steps"] = total
    if params.get("warmup_num_steps") == AUTO and params.get("warmup_ratio") is not None:
        del params["warmup_num_steps"]  # the ratio sets the warmup (a step schedule's)
    if params.get("warmup_num_steps") == AUTO:
        if warmup is None:
            warmup = SCHEDULER_PARAMS[sched.type]["warmup_num_steps"][1]
            run = params.get("total_num_steps")
            warmup = min(warmup, run) if isinstance(run, int) else warmup
        params["warmup_num_steps"] = warmup
    for name, (_, default) in SCHEDULER_PARAMS[sched.type].items():
        if params.get(name) == AUTO:
            params[name] = lr if name == "warmup_max_lr" else default
    return replace(sched, params=check_scheduler_params(sched.type, params, allow_auto=False))
