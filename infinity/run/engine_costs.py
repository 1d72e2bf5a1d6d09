"""The engine's own costs on this machine, probed for `infinity estimate`.

Owns one measurement: a small Llama trained through the engine against the same model in
plain PyTorch. What the engine adds per module with parameters (its gather and release
hooks, prefetch bookkeeping, the gradient hooks, and what re-gathered weights cost the
compute around them), less its copies and its waits for the disk, which the estimate
models apart; and the rate at which its gathers from NVMe copied their staging buffers. It
lives with the training run because it runs the engine, which the estimate package below it
may not import.

[Note: probing at the run's sizes] A tiny model (64 wide) measures the bookkeeping alone,
about 0.4 ms per module here, whatever the model. A LoRA run of a large model costs more per
module: its weights are gathered again at every use (the model is many times its live
budget), into recycled buffers copied from a staging buffer the disk has just filled, while
the other core computes; on a 0.5B model the engine added about 1 ms per module and copied
at 7-9 GB/s where a copy alone runs at 12-14. So for LoRA the probe model has three blocks
of the run's own sizes (its vocabulary 256), a live budget of one and a half blocks and a
prefetch window of one, so that every block is gathered again at each use while the next
is read ahead. Full fine-tuning keeps the tiny model: three blocks of a large model would
need their optimizer state (16 bytes per parameter) just to be probed, and its step is
the optimizer's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
import time

import torch

from infinity.config import Config, ResolvedConfig, resolve_run
from infinity.zero import model_dtype

# [Note: capped probes] The compute probe runs one micro batch of at most PROBE_TOKENS tokens
# in sequences of at most PROBE_SEQ_LEN, whatever the run asks for: a probe at the run's
# shape allocated its activations (--seq-len 100000000 was killed at 21 GB). The run's
# compute time is the probe's scaled by the FLOPs formula (`ModelShape.train_flops_per_token`,
# attention included), and its bytes come from the formulas alone. Runs within the caps
# are probed at their own shape, as before.
PROBE_SEQ_LEN = 2048
PROBE_TOKENS = 4096

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
_RUN_SIZED_LAYERS = 3
_TOKENS = 32
_REPEATS = 7


def probe_batch(shape, config: Config, seq_len: int) -> tuple[Config, int]:
    """The config and sequence length the probes run at ([Note: capped probes])."""

    micro = resolve_run(config, shape.run_facts()).train_micro_batch_size_per_gpu
    probe_seq = min(seq_len, PROBE_SEQ_LEN)
    probe_micro = min(micro, max(1, PROBE_TOKENS // probe_seq))
    if (probe_micro, probe_seq) == (micro, seq_len):
        return config, seq_len
    capped = Config.load({**config.to_dict(), "train_micro_batch_size_per_gpu": probe_micro})
    return capped, probe_seq


def scale_compute(rates, shape, probed: tuple[Config, int], run: tuple[Config, int]):
    """`rates` with the compute time of the run's micro batch, from the probed one's."""
    if probed == run:
        return rates

    def flops(config: ResolvedConfig, seq_len: int) -> int:
        micro = config.train_micro_batch_size_per_gpu
        return micro * seq_len * shape.train_flops_per_token(seq_len)

    ratio = flops(*run) / flops(*probed)
    sources = dict(rates.sources)
    sources["compute"] += (
        f"; probed at {probed[0].train_micro_batch_size_per_gpu} x {probed[1]} tokens and "
        f"scaled x {ratio:.3g} by the FLOPs formula"
    )
    return dataclasses.replace(rates, compute_s=rates.compute_s * ratio, sources=sources)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineCosts:
    """What `probe_engine_costs` measured."""

    module_overhead_s: float
    """Seconds the engine adds per module with parameters in one micro step, its copies and
    disk waits left out."""
    gather_copy_bytes_per_s: float
    """Bytes per second its gathers copied at (0.0: nothing was copied, as when gathers
    alias host homes or the model was the tiny one)."""
    run_sized: bool
    """Whether the probe model had the run's block sizes (see [Note: probing at the run's
    sizes])."""


def probe_engine_costs(
    dtype: torch.dtype,
    *,
    lora_r: int = 0,
    checkpointing: bool = False,
    nvme_path: str | os.PathLike | None = None,
    like=None,
) -> EngineCosts:
    """The engine's costs in one micro step (forward and backward, with recomputation when
    `checkpointing`): the median engine forward+backward less its copies and parameter-read
    waits, less the median plain one of the same model, over its modules; and the rate of
    its gather copies. Every weight is gathered and released at each use, as a large
    model's are, from NVMe under `nvme_path` when the run's parameters live there. With
    `lora_r` and `like` (the run's model config, a `LlamaConfig`), the model has the run's
    block sizes (see [Note: probing at the run's sizes])."""
    from infinity.models import LlamaConfig

    run_sized = bool(lora_r) and like is not None
    if run_sized:
        mcfg = LlamaConfig(
            vocab_size=_TINY["vocab_size"],
            hidden_size=like.hidden_size,
            intermediate_size=like.intermediate_size,
            num_hidden_layers=_RUN_SIZED_LAYERS,
            num_attention_heads=like.num_attention_heads,
            num_key_value_heads=like.num_key_value_heads,
        )
    else:
        mcfg = LlamaConfig(**_TINY)
    ids = torch.randint(0, mcfg.vocab_size, (1, _TOKENS))
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if run_sized:
        block = _block_numel(mcfg)
        zero["stage3_max_live_parameters"] = block * 3 // 2
        zero["stage3_prefetch_bucket_size"] = block
    # 16-bit models run the same hooks; fp16 would add the loss scaler, which is not measured
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        **({"bf16": {"enabled": True}} if dtype != torch.float32 else {}),
    }
    with contextlib.ExitStack() as stack:
        if nvme_path is not None:
            where = stack.enter_context(tempfile.TemporaryDirectory(dir=nvme_path))
            # buffers enough for the prefetch depth, as a sized run has
            zero["offload_param"] = {"device": "nvme", "nvme_path": where, "buffer_count": 16}
        overhead, copy_rate = _engine_less_plain(cfg, mcfg, ids, lora_r, checkpointing)
    return EngineCosts(overhead, copy_rate if run_sized else 0.0, run_sized)


def _block_numel(mcfg) -> int:
    from infinity.models import LlamaForCausalLM

    with torch.device("meta"):
        one = LlamaForCausalLM(dataclasses.replace(mcfg, num_hidden_layers=1))
    return sum(p.numel() for p in one.model.layers[0].parameters())


def _engine_less_plain(
    cfg: dict, mcfg, ids, lora_r: int, checkpointing: bool
) -> tuple[float, float]:
    import infinity
    from infinity.models import LlamaForCausalLM

    torch.manual_seed(0)
    with infinity.init(cfg):
        model = _adapted(LlamaForCausalLM(mcfg), lora_r)
    model.set_gradient_checkpointing(checkpointing)
    modules = _modules_with_parameters(model)
    engine = infinity.initialize(model, cfg)
    copied: list[tuple[int, float]] = []
    try:

        def engine_step() -> float:
            t0 = time.perf_counter()
            engine.backward(engine(ids, ids))
            t1 = time.perf_counter()
            engine.step()
            t = engine.last_step_telemetry()
            copied.append((t.host_to_device_bytes, t.copy_seconds))
            return t1 - t0 - t.copy_seconds - t.nvme_param_wait_seconds

        with_engine = _median_s(engine_step)
    finally:
        engine.close()
    torch.manual_seed(0)
    plain = _adapted(LlamaForCausalLM(mcfg), lora_r).to(model_dtype(Config.load(cfg)))
    plain.set_gradient_checkpointing(checkpointing)

    def plain_step() -> float:
        t0 = time.perf_counter()
        plain(ids, ids).backward()
        t1 = time.perf_counter()
        plain.zero_grad(set_to_none=True)
        return t1 - t0

    overhead = max(0.0, with_engine - _median_s(plain_step)) / modules
    steady = copied[2:]  # after the warm-ups, as the times
    nbytes, seconds = sum(b for b, _ in steady), sum(s for _, s in steady)
    return overhead, (nbytes / seconds if nbytes and seconds > 0 else 0.0)


def _adapted(model, lora_r: int):
    if not lora_r:
        return model
    from infinity.models.lora import LoraSpec, apply_lora

    return apply_lora(model, LoraSpec(r=lora_r))


def _modules_with_parameters(model: torch.nn.Module) -> int:
    return sum(1 for m in model.modules() if next(m.parameters(recurse=False), None) is not None)


def _median_s(step) -> float:
    """Median of `step()`'s own timings, after two warm-ups (the engine traces the order of
    its modules on the first)."""
    step()
    step()
    return statistics.median(step() for _ in range(_REPEATS))
