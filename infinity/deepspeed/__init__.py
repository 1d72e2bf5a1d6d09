"""DeepSpeed's training API over Infinity's engine: `import infinity.deepspeed as deepspeed`
is the one line a DeepSpeed script changes.

`initialize` returns DeepSpeed's 4-tuple (engine, optimizer, training dataloader, lr
scheduler); `add_config_arguments`, `init_distributed`, `zero.Init`,
`zero.GatheredParameters` and the common `comm` calls keep their meaning. What has no
equivalent here (pipeline and tensor parallelism, MoE, the `deepspeed` launcher, DeepSpeed's
ops) raises NotImplementedError naming what to do instead. docs/deepspeed.md has the table.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import infinity
from infinity.config import Config
from infinity.config.parse import read_json
from infinity.deepspeed import comm, zero
from infinity.deepspeed.client import (
    ClientSchedule,
    ConfigScheduler,
    EngineOptimizer,
    lr_holder,
    plan_client,
)
from infinity.deepspeed.comm import init_distributed
from infinity.deepspeed.engine import DeepSpeedEngine

logger = logging.getLogger(__name__)

__all__ = [
    "DeepSpeedEngine",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
    "zero",
]

_DEEPSPEED_DEFAULTS = {"gradient_clipping": 1.0}
"""Keys whose DeepSpeed default differs from Infinity's: a DeepSpeed config that leaves
them out gets DeepSpeed's value (DeepSpeed 0.19 clips gradients at norm 1.0 by default;
Infinity's own config does not clip unless asked)."""

_LOADER_KEYS = ("dataloader_drop_last",)
"""Top-level DeepSpeed keys this layer reads (for `training_data`) before the engine's config."""


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: --deepspeed and --deepspeed_config FILE (read by
    `initialize(args=...)`)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (accepted; the engine is always used)")  # fmt: skip
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file")  # fmt: skip
    return parser


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, EngineOptimizer, DataLoader | None, Any]:
    """DeepSpeed's `initialize`: (engine, optimizer, training_dataloader, lr_scheduler)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize: model= must be a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError(
            "initialize: mpu and mesh_param (model, tensor or sequence parallelism) are not "
            "implemented: every rank torchrun starts is one data-parallel rank"
        )
    raw = _config_dict(args, config, config_params)
    loader_keys = {k: raw.pop(k) for k in _LOADER_KEYS if k in raw}
    for key, value in _DEEPSPEED_DEFAULTS.items():
        raw.setdefault(key, value)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(
            model_parameters if model_parameters is not None else model.parameters()
        )
    if optimizer is not None and "optimizer" in raw:
        raise ValueError(
            "initialize: an optimizer is given both to initialize() and in the config's "
            "'optimizer' section; keep one of them"
        )
    if optimizer is None and "optimizer" not in raw:
        _warn_default_optimizer()
    plan = plan_client(model, optimizer, model_parameters, raw.get("optimizer"))
    if plan.optimizer is not None:
        raw["optimizer"] = plan.optimizer
    for name, param in model.named_parameters():
        if name in plan.frozen:
            param.requires_grad_(False)
    engine = infinity.initialize(
        model, raw, no_decay=plan.no_decay, groups=plan.groups, comm=comm.shared()
    )
    zero.mark_partitioned(model, engine)
    holder, schedule = _client_schedule(engine, optimizer, lr_scheduler, raw)
    facade = EngineOptimizer(engine, holder)
    loader = _loader(engine, training_data, collate_fn, loader_keys)
    return (
        DeepSpeedEngine(
            engine, optimizer=facade, lr_scheduler=schedule, training_dataloader=loader
        ),
        facade,
        loader,
        schedule,
    )


def _warn_default_optimizer() -> None:
    logger.warning(
        "initialize: no optimizer (neither optimizer= nor the config's 'optimizer' section); "
        "DeepSpeed would refuse backward(), here the engine steps with Infinity's default, "
        "AdamW at lr 1e-3; add an 'optimizer' section to choose"
    )


def _config_dict(args: Any, config: Any, config_params: Any) -> dict:
    """The DeepSpeed config as a dict, from `config`/`config_params` or `args.deepspeed_config`."""
    if config is not None and config_params is not None and config is not config_params:
        raise ValueError("initialize: config= and config_params= are both given; keep one")
    given = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if given is not None and from_args is not None:
        raise ValueError(
            f"initialize: a config is given both as args.deepspeed_config ({from_args!r}) and "
            "as config=; keep one of them"
        )
    source = given if given is not None else from_args
    if source is None:
        raise ValueError(
            "initialize: no DeepSpeed config; pass config= (a dict or a JSON path), or args "
            "with --deepspeed_config FILE (see add_config_arguments)"
        )
    if isinstance(source, Config):
        return source.to_dict()
    if isinstance(source, (str, os.PathLike)):
        source = read_json(os.fspath(source))
    if not isinstance(source, Mapping):
        raise TypeError(
            f"initialize: the config must be a dict or a JSON path, got {type(source).__name__}"
        )
    return dict(source)


def _client_schedule(
    engine: infinity.Engine, optimizer: Any, lr_scheduler: Any, raw: dict
) -> tuple[torch.optim.Optimizer | None, Any]:
    """(the torch optimizer whose param groups carry the lr, the scheduler to return)."""
    holder = optimizer
    if lr_scheduler is None:
        if raw.get("scheduler"):
            return holder, ConfigScheduler(engine)
        if holder is not None:  # each group's lr, as the client optimizer would step them
            engine.lr_schedule = ClientSchedule(None, holder)
        return holder, None
    if raw.get("scheduler"):
        raise ValueError(
            "initialize: an lr_scheduler is given both to initialize() and in the config's "
            "'scheduler' section; keep one of them"
        )
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        holder = holder if holder is not None else lr_holder(engine.lr_schedule.lr)
        lr_scheduler = lr_scheduler(holder)
    elif holder is None or getattr(lr_scheduler, "optimizer", None) is not holder:
        raise ValueError(
            "initialize: lr_scheduler must be built on the optimizer given to initialize(); "
            "without one, pass a callable that builds the scheduler from an optimizer"
        )
    engine.lr_schedule = ClientSchedule(lr_scheduler, holder)
    return holder, lr_scheduler


def _loader(engine: infinity.Engine, data: Any, collate_fn: Any, keys: dict) -> DataLoader | None:
    """`training_data` in micro batches, each rank its own share (DeepSpeed's sampler: a
    DistributedSampler over the ranks)."""
    if data is None:
        return None
    c = engine.comm
    return DataLoader(
        data,
        batch_size=engine.config.train_micro_batch_size_per_gpu,
        sampler=DistributedSampler(data, num_replicas=c.world_size, rank=c.rank),
        collate_fn=collate_fn,
        drop_last=bool(keys.get("dataloader_drop_last", False)),
    )


_NOT_PORTED = {
    "pipe": "pipeline parallelism is not implemented: data-parallel ranks only (torchrun)",
    "PipelineModule": "pipeline parallelism is not implemented: data-parallel ranks only",
    "moe": "mixture-of-experts layers are not implemented",
    "ops": "DeepSpeed's kernels are not used: CPU-Adam runs inside the engine; set the "
    "optimizer in the config or pass a torch.optim.Adam/AdamW",
    "checkpointing": "use torch.utils.checkpoint (or the model's gradient_checkpointing_enable)",
    "init_inference": "inference engines are not implemented; use `infinity generate` or "
    "the exported model with transformers",
    "launcher": "there is no deepspeed launcher: start ranks with `torchrun --nproc_per_node N "
    "script.py`",
    "tp_model_init": "tensor parallelism is not implemented: data-parallel ranks only",
    "utils": "there is no zero_to_fp32 consolidation of a checkpoint: take the full weights "
    "from the live engine, inside zero.GatheredParameters(list(engine.module.parameters())) "
    "(fp32 in an fp32 run) or with engine.save_16bit_model(dir)",
}


def __getattr__(name: str) -> Any:
    why = _NOT_PORTED.get(name)
    if why is None:
        raise AttributeError(f"module 'infinity.deepspeed' has no attribute {name!r}")
    raise NotImplementedError(f"deepspeed.{name} is not implemented by infinity.deepspeed: {why}")
