"""`DeepSpeedEngine`: DeepSpeed's engine names over an `infinity.Engine`.

Every call maps onto the engine's own (the table in docs/deepspeed.md); the engine's other
methods (`memory_stats`, `close`, `save_16bit_model`, ...) pass through. A DeepSpeed engine
name with no equivalent here raises NotImplementedError naming what to do instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from infinity import checkpoint
from infinity.engine import Engine

logger = logging.getLogger(__name__)

_PIPELINE = "pipeline parallelism is not implemented: data-parallel ranks only (torchrun)"
NOT_PORTED: dict[str, str] = {
    "train_batch": _PIPELINE,
    "eval_batch": _PIPELINE,
    "is_pipe_parallel": _PIPELINE,
    "set_train_batch_size": "set train_batch_size in the config; the batch is fixed per run",
    "set_train_micro_batch_size": "set train_micro_batch_size_per_gpu in the config",
    "get_mom": "the betas are the optimizer's: read optimizer.param_groups[0]['betas']",
    "load_universal_checkpoint": "checkpoints here load on any world size as they are",
    "mpu": "model parallelism is not implemented: data-parallel ranks only",
    "has_moe_layers": "mixture-of-experts layers are not implemented",
    "sparse_allreduce_bucket": "gradients are dense fp32 sums",
    "get_sequence_parallel_group": "sequence parallelism is not implemented",
}
"""DeepSpeed engine names with no equivalent here -> why, and what to do instead."""


class Monitor:
    """DeepSpeed's `engine.monitor` with no monitor enabled (the config's `tensorboard`,
    `wandb`, `csv_monitor` blocks are refused, naming metrics.jsonl): `enabled` is False and
    `write_events` writes nothing, as DeepSpeed's does then."""

    enabled = False

    def write_events(self, event_list: list) -> None:
        del event_list


class DeepSpeedEngine:
    """What `infinity.deepspeed.initialize` returns first: `engine(batch)`,
    `engine.backward(loss)`, `engine.step()`, with DeepSpeed's accessors."""

    def __init__(
        self, engine: Engine, *, optimizer: Any, lr_scheduler: Any, training_dataloader: Any = None
    ) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.monitor = Monitor()
        self._in_no_sync = False

    # ---- the loop -----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.forward(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        if retain_graph:
            raise NotImplementedError(
                "backward(retain_graph=True): the engine frees each gradient as it is "
                "produced; compute every loss you differentiate in one forward and sum them"
            )
        self.engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        if lr_kwargs:
            raise NotImplementedError(
                f"step(lr_kwargs={lr_kwargs!r}): the schedule takes no per-step arguments "
                "here; drive the lr with a client torch lr scheduler instead"
            )
        if self._in_no_sync:
            raise RuntimeError(
                "step() inside no_sync(): leave the no_sync block before step(), as DeepSpeed "
                "requires"
            )
        self.engine.step()

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's no_sync at stages 0 and 1: backward() inside it is reduced with the rest
        of the accumulation at the boundary, as the engine always does (so nothing changes);
        stages 2 and 3 refuse it, as DeepSpeed does."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise NotImplementedError(
                f"no_sync() is incompatible with ZeRO stage {stage}'s gradient partitioning "
                "(DeepSpeed refuses it too): call backward() on each micro batch and step() "
                "after each; the engine reduces at the accumulation boundary"
            )
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    # ---- accessors ----------------------------------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.accelerator.device

    @property
    def local_rank(self) -> int:
        return self.engine.comm.local_rank

    @property
    def global_rank(self) -> int:
        return self.engine.comm.rank

    @property
    def world_size(self) -> int:
        return self.engine.comm.world_size

    dp_world_size = world_size

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def global_samples(self) -> int:
        """Samples of the optimizer steps so far (skipped ones included, as DeepSpeed counts)."""
        return self.engine.global_steps * self.train_batch_size()

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    def get_lr(self) -> list[float]:
        """The lr of the next optimizer step, one entry per parameter group."""
        return self.engine.get_lr()

    def get_global_grad_norm(self) -> float | None:
        return self.engine.get_global_grad_norm()

    def was_step_skipped(self) -> bool:
        return self.engine.was_step_skipped

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.engine.config.train_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_stage(self) -> int:
        return int(self.engine.config.zero_optimization.stage)

    def fp16_enabled(self) -> bool:
        return self.engine.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.precision == "bf16"

    def gradient_clipping(self) -> float:
        return float(self.engine.config.gradient_clipping)

    def parameters(self, recurse: bool = True):
        return self.engine.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.engine.module.named_parameters(*args, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write `save_dir/tag` (default `global_step{N}`, DeepSpeed's name) atomically, with
        `client_state`; every rank calls it. The checkpoint always becomes the one `latest`
        names (it is the commit point of the atomic save), whatever `save_latest` says."""
        if not save_latest:
            logger.warning(
                "save_checkpoint(save_latest=False): ignored; 'latest' always names the newest "
                "complete checkpoint (load another with load_checkpoint(dir, tag))"
            )
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        self.engine.save_checkpoint(
            save_dir, tag, client_state=client_state,
            include_frozen=not exclude_frozen_parameters,
        )  # fmt: skip
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict | None]:
        """Resume exactly from `load_dir/tag` (default: the latest). Returns the checkpoint's
        path and its client_state, or (None, None) when `load_dir` holds no checkpoint (as
        DeepSpeed does)."""
        partial = {
            "load_module_strict": not load_module_strict,
            "load_optimizer_states": not load_optimizer_states,
            "load_lr_scheduler_states": not load_lr_scheduler_states,
            "load_module_only": load_module_only,
            "custom_load_fn": custom_load_fn is not None,
        }
        asked = [k for k, v in partial.items() if v]
        if asked:
            raise NotImplementedError(
                f"load_checkpoint: {', '.join(asked)} is not implemented: a checkpoint "
                "resumes the whole run exactly (weights, optimizer, schedule, data position); "
                "to start a new run from its weights, `infinity export` it and load the export"
            )
        if tag is None and not checkpoint.list_checkpoints(load_dir):
            logger.warning("load_checkpoint: no checkpoint in %s; nothing loaded", load_dir)
            return None, None
        return self.engine.load_checkpoint(load_dir, tag)

    def __getattr__(self, name: str) -> Any:
        why = NOT_PORTED.get(name)
        if why is not None:
            raise NotImplementedError(f"engine.{name} is not implemented here: {why}")
        if name.startswith("__") or name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)
