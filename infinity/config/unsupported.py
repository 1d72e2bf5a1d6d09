"""DeepSpeed settings Infinity does not implement, and why.

A config copied from DeepSpeed often carries features Infinity has no equivalent for. Each
entry says why and what to do instead. A value that leaves the feature off (DeepSpeed's
default: `false`, a section with `"enabled": false`, ...) is accepted, because it asks for
what Infinity does anyway; any other value is refused with the reason, never silently
ignored and never answered with "unknown key" and a guess at an unrelated key.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OFF = object()
"""Inert marker: an object whose "enabled" is false (a disabled DeepSpeed feature section)."""


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A DeepSpeed key Infinity does not implement."""

    why: str
    """One sentence: what Infinity does instead, or what to use."""
    inert: tuple[Any, ...] = ()
    """Values that leave the feature off; they are accepted (`OFF`: a disabled section)."""

    def accepts(self, value: Any) -> bool:
        """Whether `value` leaves the feature off."""
        for allowed in self.inert:
            if allowed is OFF:
                if isinstance(value, Mapping) and value.get("enabled", True) is False:
                    return True
            elif _same(value, allowed):
                return True
        return False

    def message(self, path: str, value: Any) -> str:
        shown = "a section" if isinstance(value, Mapping) else json.dumps(value, default=repr)
        off = ["a section with enabled: false" if v is OFF else json.dumps(v) for v in self.inert]
        fix = "remove it" + (f" or set it to {' or '.join(off)}" if off else "")
        return f"{path}: {shown} is not supported by Infinity: {self.why}; {fix}"


def _same(value: Any, allowed: Any) -> bool:
    """JSON equality: true is not 1, but 1 is 1.0."""
    if isinstance(value, bool) or isinstance(allowed, bool) or None in (value, allowed):
        return value is allowed
    return value == allowed


_DATA_PARALLEL = "Infinity shards ZeRO stage 3 with offload over data-parallel ranks only"
# [Note: gradient buckets] in infinity/zero/grad_reduce.py: the reduce-scatter sums the
# device gradients in communication_data_type; each rank divides its shard by the world size
# in fp32.
_GRAD_REDUCE = (
    "gradients are reduce-scattered in communication_data_type (the training dtype unless "
    "set) and averaged in fp32"
)

_METRICS = (
    "the engine does not log to it; `infinity train` writes metrics.jsonl, and a training "
    "loop can log engine.memory_stats() and engine.last_step_telemetry() itself"
)
TOP_LEVEL: dict[str, Unsupported] = {
    "amp": Unsupported("NVIDIA Apex AMP is not used; enable fp16 or bf16 instead", (OFF,)),
    "torch_autocast": Unsupported(
        "the model runs in the fp16/bf16 training dtype itself (fp16.auto_cast casts the "
        "inputs); enable fp16 or bf16 instead",
        (OFF,),
    ),
    "prescale_gradients": Unsupported(
        f"{_GRAD_REDUCE}, dividing by the world size after the sum; scaling before it is "
        "not implemented",
        (False,),
    ),
    "gradient_predivide_factor": Unsupported(
        f"{_GRAD_REDUCE}, dividing by the world size after the sum; dividing before it is "
        "not implemented",
        (1.0,),
    ),
    "sparse_gradients": Unsupported("gradient sums are dense fp32 buffers", (False,)),
    "sparse_attention": Unsupported(
        "block-sparse attention is a DeepSpeed kernel; use the model's own attention"
    ),
    "pipeline": Unsupported(f"{_DATA_PARALLEL}, without pipeline parallelism"),
    "tensor_parallel": Unsupported(
        f"{_DATA_PARALLEL}, without tensor parallelism: the model runs whole, its parameters "
        "gathered one module at a time"
    ),
    "sequence_parallel_size": Unsupported(f"{_DATA_PARALLEL}, without sequence parallelism", (1,)),
    "compression_training": Unsupported(
        "quantization-aware training, pruning and distillation are not implemented"
    ),
    "quantize_training": Unsupported("quantization-aware training is not implemented", (OFF,)),
    "data_efficiency": Unsupported(
        "curriculum learning and data routing are not implemented; order the data yourself",
        (OFF,),
    ),
    "curriculum_learning": Unsupported(
        "curriculum learning is not implemented; order the data yourself", (OFF,)
    ),
    "progressive_layer_drop": Unsupported("progressive layer drop is not implemented", (OFF,)),
    "eigenvalue": Unsupported("eigenvalue computation is not implemented", (OFF,)),
    "elasticity": Unsupported(
        "elastic batch sizes are not implemented; set the batch sizes explicitly", (OFF,)
    ),
    "autotuning": Unsupported(
        "there is no autotuner; `infinity bench aio` measures the I/O settings for a disk",
        (OFF,),
    ),
    "tensorboard": Unsupported(_METRICS, (OFF,)),
    "wandb": Unsupported(_METRICS, (OFF,)),
    "csv_monitor": Unsupported(_METRICS, (OFF,)),
    "comet": Unsupported(_METRICS, (OFF,)),
    "flops_profiler": Unsupported(
        "there is no FLOPs profiler; `infinity train` records TFLOPS per step in metrics.jsonl",
        (OFF,),
    ),
    "comms_logger": Unsupported(
        "there is no communication logger; benchmarks/scale_out.py measures the bytes a step "
        "communicates",
        (OFF,),
    ),
    "memory_breakdown": Unsupported(
        "engine.memory_stats() reports the live, peak, host, pinned and NVMe figures", (False,)
    ),
    "dump_state": Unsupported(
        "`infinity config FILE` prints the configuration as Infinity reads it", (False,)
    ),
    "checkpoint": Unsupported(
        "checkpoints are Infinity's own checksummed directories: every save checks its tag, "
        "and a checkpoint loads on any world size as it is",
        ({}, {"tag_validation": "Warn"}, {"tag_validation": "warn"}),
    ),
    "data_types": Unsupported(
        "gradients are always accumulated in fp32",
        ({}, {"grad_accum_dtype": None}, {"grad_accum_dtype": "fp32"}),
    ),
}

ZERO: dict[str, Unsupported] = {
    "zero_hpz_partition_size": Unsupported(
        "hierarchical partitioning (ZeRO++ hpZ) is not implemented",
        (1,),
    ),
    "zero_quantized_weights": Unsupported(
        "weights are gathered in the training dtype, not quantized (ZeRO++ qwZ)", (False,)
    ),
    "zero_quantized_nontrainable_weights": Unsupported(
        "frozen weights are kept in the training dtype, not quantized", (False,)
    ),
    "zero_quantized_gradients": Unsupported(
        "gradients are reduce-scattered in communication_data_type and accumulated in fp32, not "
        "quantized (ZeRO++ qgZ)",
        (False,),
    ),
    "zeropp_loco_param": Unsupported(
        "LoCo error feedback belongs to quantized gradients (ZeRO++), not implemented", (None,)
    ),
    "mics_shard_size": Unsupported("MiCS sharding groups are not implemented", (-1,)),
    "mics_hierarchical_params_gather": Unsupported(
        "MiCS sharding groups are not implemented", (False,)
    ),
    "cpu_offload": Unsupported(
        "it is DeepSpeed's deprecated switch; use offload_optimizer.device 'cpu' (the default)",
        (False,),
    ),
    "cpu_offload_param": Unsupported(
        "it is DeepSpeed's deprecated switch; use offload_param.device 'cpu' (the default)",
        (False,),
    ),
    "cpu_offload_use_pin_memory": Unsupported(
        "it is DeepSpeed's deprecated switch; use offload_param.pin_memory and "
        "offload_optimizer.pin_memory",
        (False,),
    ),
    "stage3_model_persistence_threshold": Unsupported(
        "persistent parameters are capped by stage3_max_live_parameters (they leave "
        "the largest parameter's room); lower it or stage3_param_persistence_threshold instead",
        (sys.maxsize,),
    ),
    "model_persistence_threshold": Unsupported(
        "persistent parameters are capped by stage3_max_live_parameters (they leave "
        "the largest parameter's room); lower it or stage3_param_persistence_threshold instead",
        (sys.maxsize,),
    ),
    "legacy_stage1": Unsupported(
        "DeepSpeed's deprecated stage-1 implementation is not one; stage 1 runs as every "
        "stage does here (docs/deepspeed.md)",
        (False,),
    ),
}

OFFLOAD_OPTIMIZER: dict[str, Unsupported] = {
    "ratio": Unsupported(
        "partial optimizer offload is not implemented: the whole optimizer steps on the CPU",
        (1.0,),
    ),
}
