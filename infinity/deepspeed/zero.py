"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters` with DeepSpeed's meaning.

Under `Init` (`infinity.init`) each parameter is built straight into its host partition, whole:
the sharding happens when `initialize` partitions the model. Until then a parameter *is* its
partition, so `GatheredParameters` has nothing to gather: changes made inside it land in the
partition as they are made, and with several ranks the ones of `modifier_rank` are sent to
every rank when the block ends (each rank must start from the same weights). After
`initialize` a parameter is released between uses; gathering it here is not implemented.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from infinity import zero as _zero
from infinity.config import Config
from infinity.deepspeed import comm as ds_comm

_UNDER_ENGINE: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
"""Parameters `infinity.deepspeed.initialize` partitioned (released between uses), by id
(a tensor's `==` is elementwise, so they cannot be set members)."""


def mark_partitioned(model: nn.Module) -> None:
    _UNDER_ENGINE.update({id(p): p for p in model.parameters()})


class Init:
    """Build the model's parameters as host partitions (`infinity.init`), with the config
    `config_dict_or_path` (or `config`); `enabled=False` builds as usual."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: dict | str | os.PathLike | None = None,
        config: dict | str | os.PathLike | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **kwargs: Any,
    ) -> None:
        if mpu is not None or data_parallel_group is not None:
            raise NotImplementedError(
                "zero.Init: mpu and data_parallel_group are not implemented: every rank "
                "torchrun starts is one data-parallel rank"
            )
        source = config_dict_or_path if config_dict_or_path is not None else config
        cfg = Config.load(source if source is not None else {})
        if remote_device not in (None, "cpu", cfg.zero_optimization.offload_param.device):
            raise ValueError(
                f"zero.Init: remote_device={remote_device!r} differs from the config's "
                "zero_optimization.offload_param.device; set it there and leave remote_device out"
            )
        precision = _zero.model_dtype(cfg.resolve())
        if dtype is not None and dtype != precision:
            raise ValueError(
                f"zero.Init: dtype={dtype} but the config trains in {precision}; set "
                "fp16.enabled or bf16.enabled to match, or leave dtype out"
            )
        self._cm = _zero.init(cfg) if enabled and module is None else contextlib.nullcontext()

    def __enter__(self) -> Init:
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)


class GatheredParameters:
    """`with GatheredParameters(params, modifier_rank=0):` the parameters whole; what rank
    `modifier_rank` writes into them reaches every rank when the block ends."""

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        taken = [p for p in self.params if _UNDER_ENGINE.get(id(p)) is p]
        if enabled and taken:
            raise NotImplementedError(
                "GatheredParameters: these parameters are partitioned by initialize() and "
                "released between uses; change weights before initialize (inside or after the "
                "zero.Init block), read them with engine.named_parameters_host(), or resume "
                "with engine.load_checkpoint"
            )

    def __enter__(self) -> GatheredParameters:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled or self.modifier_rank is None or exc[0] is not None:
            return
        comm = ds_comm.shared()
        if comm.world_size == 1:
            return
        values = comm.broadcast_object(
            [p.detach().cpu() for p in self.params], src=self.modifier_rank
        )
        with torch.no_grad():
            for p, v in zip(self.params, values, strict=True):
                p.copy_(v)
