"""What a training run knows that its config does not, gathered for its one resolution
(`infinity.config.RunFacts`): its length in optimizer steps, and every parameter's size as
the engine will build the model, LoRA adapters included, read off a meta model (no bytes)."""

from __future__ import annotations

import math

import torch

from infinity.config import Config
from infinity.config.resolve import batch_sizes
from infinity.data import PackedDataset
from infinity.models import hf_auto
from infinity.models.lora import LoraSpec, apply_lora, lora_targets
from infinity.run.options import RunOptions


def run_steps(options: RunOptions, config: Config, data: PackedDataset, world_size: int) -> int:
    """The optimizer steps the run ends at: --steps, or one pass over `data`."""
    _, micro, accum = batch_sizes(config, world_size)  # the run's length needs these first
    if micro > data.num_sequences:
        # A micro batch is one forward: more sequences than the data holds is a mistake,
        # and a large one would exhaust memory before failing.
        raise ValueError(
            f"a micro batch of {micro} sequences (--micro-batch or "
            f"train_micro_batch_size_per_gpu) is more than the {data.num_sequences} "
            f"sequences of {data.seq_len} tokens in {options.data}; lower it or use more data"
        )
    per_step = micro * accum * world_size
    return options.steps or max(1, math.ceil(data.num_sequences / per_step))


def engine_numels(
    spec: hf_auto.CausalLMSpec, lora: LoraSpec | None
) -> tuple[tuple[int, ...], list[str] | None]:
    """Each parameter's elements, in the order the engine meets them (`model.parameters()`:
    each tied parameter once), with `lora`'s adapters where `apply_lora` puts them; and the
    layer names the adapters go on (None without LoRA). One meta model answers both."""
    if lora is None:  # the unique parameters, in model order
        return tuple(math.prod(s) for s in spec.param_shapes.values()), None
    with torch.device("meta"):
        meta = hf_auto.build(spec.hf_config, init_weights=False)
        targets = lora_targets(meta, lora)
        meta = apply_lora(meta, lora)
    return tuple(p.numel() for p in meta.parameters()), targets
