"""DeepSpeed's key names per config section: the aliases of each field, the keys accepted and
ignored, the unsupported ones, and the bounds of numeric fields.

Tables only; `infinity.config.parse` applies them ([Note: keys] there).
"""

from __future__ import annotations

from infinity.config.sections import (
    AioConfig,
    ConfigFields,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    ZeroConfig,
)
from infinity.config.unsupported import OFFLOAD_OPTIMIZER, TOP_LEVEL, ZERO, Unsupported

KEYS: dict[type, dict[str, tuple[str, ...]]] = {
    ZeroConfig: {
        "max_live_parameters": ("stage3_max_live_parameters", "max_live_parameters"),
        "prefetch_bucket_size": ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
        "max_reuse_distance": ("stage3_max_reuse_distance", "max_reuse_distance"),
        "param_persistence_threshold": (
            "stage3_param_persistence_threshold",
            "param_persistence_threshold",
        ),
        "gather_16bit_weights_on_model_save": (
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ),
    },
    AioConfig: {"thread_count": ("intra_op_parallelism", "thread_count")},
    ConfigFields: {"bf16": ("bf16", "bfloat16")},
}

IGNORED: dict[type, frozenset[str]] = {
    ConfigFields: frozenset(
        {
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
            "activation_checkpointing",
        }
    ),
    ZeroConfig: frozenset(
        {
            "reduce_scatter",
            "allgather_partitions",
            "allgather_bucket_size",
            "round_robin_gradients",
            "load_from_fp32_weights",
            "elastic_checkpoint",
            "ignore_unused_parameters",
            "memory_efficient_linear",
            "log_trace_cache_warnings",
            "use_multi_rank_bucket_allreduce",
        }
    ),
    AioConfig: frozenset({"use_gds"}),  # checked to be false in parse._parse_aio
}

UNSUPPORTED: dict[type, dict[str, Unsupported]] = {
    ConfigFields: TOP_LEVEL,
    ZeroConfig: ZERO,
    OffloadOptimizerConfig: OFFLOAD_OPTIMIZER,
}

# (class, field) -> (bound, strict): values must be >= bound (> bound when strict).
MINIMUM: dict[tuple[type, str], tuple[float, bool]] = {
    (ConfigFields, "train_batch_size"): (1, False),
    (ConfigFields, "train_micro_batch_size_per_gpu"): (1, False),
    (ConfigFields, "gradient_accumulation_steps"): (1, False),
    (ConfigFields, "gradient_clipping"): (0, False),
    (ConfigFields, "steps_per_print"): (1, False),
    (FP16Config, "loss_scale"): (0, False),
    (FP16Config, "initial_scale_power"): (0, False),
    (FP16Config, "loss_scale_window"): (1, False),
    (FP16Config, "hysteresis"): (1, False),
    (FP16Config, "min_loss_scale"): (0, True),
    (OptimizerConfig, "lr"): (0, False),
    (OptimizerConfig, "eps"): (0, False),
    (OptimizerConfig, "weight_decay"): (0, False),
    (OffloadParamConfig, "buffer_count"): (1, False),
    (OffloadParamConfig, "buffer_size"): (1, False),
    (OffloadParamConfig, "max_in_cpu"): (0, False),
    (OffloadOptimizerConfig, "buffer_count"): (3, False),
    (OffloadOptimizerConfig, "max_in_cpu"): (0, False),
    (OffloadOptimizerConfig, "gradients_on_device"): (0, False),
    (OffloadOptimizerConfig, "overlap_numel"): (0, False),
    (ZeroConfig, "max_live_parameters"): (1, False),
    (ZeroConfig, "prefetch_bucket_size"): (0, False),
    (ZeroConfig, "max_reuse_distance"): (0, False),
    (ZeroConfig, "keep_weights_numel"): (0, False),
    (ZeroConfig, "param_persistence_threshold"): (0, False),
    (ZeroConfig, "sub_group_size"): (1, False),
    (ZeroConfig, "reduce_bucket_size"): (1, False),
    (AioConfig, "block_size"): (1, False),
    (AioConfig, "queue_depth"): (1, False),
    (AioConfig, "thread_count"): (1, False),
}


# Why a bound holds, where the range alone does not say it.
BOUND_REASON: dict[tuple[type, str], str] = {
    (OffloadOptimizerConfig, "buffer_count"): (
        "the NVMe optimizer pipeline holds one sub-group being read ahead, one being stepped "
        "and one being written back (4, the default, lets reads run two sub-groups ahead)"
    ),
}
