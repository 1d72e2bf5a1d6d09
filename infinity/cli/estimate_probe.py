"""The engine's own cost per module, probed for `infinity estimate` on this machine.

Owns one measurement: a tiny Llama trained through the engine against the same model in
plain PyTorch, so the difference is what the engine adds per module with parameters (its
gather and release hooks, prefetch bookkeeping, the gradient hooks) whatever the model
size. It lives with the command line because it runs the engine, which the estimate package
below it may not import.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time

import torch

from infinity.config import Config
from infinity.zero import model_dtype

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
_TOKENS = 32
_REPEATS = 7


def probe_module_overhead_s(
    dtype: torch.dtype,
    *,
    lora_r: int = 0,
    checkpointing: bool = False,
    nvme_path: str | os.PathLike | None = None,
) -> float:
    """Seconds the engine adds per module with parameters in one micro step (forward and
    backward, with recomputation when `checkpointing`): the median engine forward+backward of
    a tiny Llama less the median plain one of the same model, over its modules. Every weight
    is gathered and released at each use, as a large model's are (none is small enough to
    stay gathered there), from NVMe under `nvme_path` when the run's parameters live there
    (a read, the staging pool and the release per gather; the bytes themselves are the
    estimate's copy and disk terms)."""
    from infinity.models import LlamaConfig

    mcfg = LlamaConfig(**_TINY)
    ids = torch.randint(0, mcfg.vocab_size, (1, _TOKENS))
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
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
        return _engine_less_plain_s(cfg, mcfg, ids, lora_r, checkpointing)


def _engine_less_plain_s(cfg: dict, mcfg, ids, lora_r: int, checkpointing: bool) -> float:
    import infinity
    from infinity.models import LlamaForCausalLM

    torch.manual_seed(0)
    with infinity.init(cfg):
        model = _adapted(LlamaForCausalLM(mcfg), lora_r)
    model.set_gradient_checkpointing(checkpointing)
    modules = _modules_with_parameters(model)
    engine = infinity.initialize(model, cfg)
    try:

        def engine_step() -> float:
            t0 = time.perf_counter()
            engine.backward(engine(ids, ids))
            t1 = time.perf_counter()
            engine.step()
            return t1 - t0

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

    return max(0.0, with_engine - _median_s(plain_step)) / modules


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
