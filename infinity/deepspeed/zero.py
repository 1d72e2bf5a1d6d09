"""`deepspeed.zero.Init` and `deepspeed.zero.GatheredParameters` with DeepSpeed's meaning.

Under `Init` (`infinity.init`) each parameter is built straight into its host partition, whole:
the sharding happens when `initialize` partitions the model. Until then a parameter *is* its
partition, so `GatheredParameters` has nothing to gather: changes made inside it land in the
partition as they are made, and with several ranks the ones of `modifier_rank` are sent to
every rank when the block ends (each rank must start from the same weights).

After `initialize` a parameter is released between uses and its weights live in two places:
its 16-bit home (this rank's shard, host or NVMe) and the optimizer's fp32 master (RAM or
NVMe state tier). Entering the block gathers each whole parameter onto every rank (a
collective: every rank enters); at the exit, with `modifier_rank`, that rank's values are
sent to every rank and written to both places, and any gathered copy is refreshed, so the
next forward and the next optimizer step start from them (moments and step count kept).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infinity import zero as _zero
from infinity.config import Config, RunFacts, resolve_run
from infinity.deepspeed import comm as ds_comm

if TYPE_CHECKING:
    from infinity.engine import Engine
    from infinity.zero.param import OffloadParam

_UNDER_ENGINE: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
"""Parameters `infinity.deepspeed.initialize` partitioned (released between uses), by id
(a tensor's `==` is elementwise, so they cannot be set members)."""
_ENGINE_OF: weakref.WeakValueDictionary[int, Engine] = weakref.WeakValueDictionary()
"""The engine that partitioned each of them, by the parameter's id."""


def mark_partitioned(model: nn.Module, engine: Engine) -> None:
    for p in model.parameters():
        _UNDER_ENGINE[id(p)] = p
        _ENGINE_OF[id(p)] = engine


def _records(params: list[nn.Parameter]) -> tuple[Engine | None, list[OffloadParam]]:
    """The engine that partitioned `params` and their records (none: not partitioned)."""
    taken = [p for p in params if _UNDER_ENGINE.get(id(p)) is p]
    if not taken:
        return None, []
    engines = {id(_ENGINE_OF[id(p)]): _ENGINE_OF[id(p)] for p in taken}
    if len(taken) != len(params) or len(engines) != 1:
        raise ValueError(
            "GatheredParameters: the parameters belong to different engines (or some to "
            "none); gather each engine's parameters in a block of their own"
        )
    engine = next(iter(engines.values()))
    by_param = {id(r.param): r for r in engine.parts.records}
    return engine, list({id(r): r for r in (by_param[id(p)] for p in taken)}.values())


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
        precision = _zero.model_dtype(resolve_run(cfg, RunFacts()))
        if dtype is not None and dtype != precision:
            raise ValueError(
                f"zero.Init: dtype={dtype} but the config trains in {precision}; set "
                "fp16.enabled or bf16.enabled to match, or leave dtype out"
            )
        ds_comm.use_rank_device()  # before the build picks its device
        self._cm = _zero.init(cfg) if enabled and module is None else contextlib.nullcontext()

    def __enter__(self) -> Init:
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)


class GatheredParameters:
    """`with GatheredParameters(params, modifier_rank=0):` the parameters whole on every
    rank; what rank `modifier_rank` writes into them reaches every rank (and, after
    `initialize`, the engine's weights and fp32 masters) when the block ends. Without a
    `modifier_rank` changes are discarded, as in DeepSpeed."""

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
        self._engine, self._records = _records(self.params) if enabled else (None, [])
        self._stubs: list[torch.Tensor] = []

    def __enter__(self) -> GatheredParameters:
        if self._engine is None:
            return self
        engine = self._engine
        engine._check_open("GatheredParameters")
        engine.parts.coordinator.check_between_iterations("GatheredParameters")
        world = engine.comm.world_size
        if self.modifier_rank is not None and not 0 <= self.modifier_rank < world:
            raise ValueError(
                f"GatheredParameters: modifier_rank={self.modifier_rank} is not a rank of "
                f"{world}; pass a rank in [0, {world}) or None to only read"
            )
        for rec in self._records:  # the gathers are collectives: every rank, same order
            full = rec.read_full().view(rec.shape).to(rec.device)
            self._stubs.append(rec.param.data)
            rec.param.data = full
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self._engine is not None:
            self._exit_engine(exc[0] is None)
            return
        if self.modifier_rank is None or exc[0] is not None:
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

    def _exit_engine(self, ok: bool) -> None:
        """Put back each parameter's released stub (or live buffer); with `modifier_rank`
        and no exception, write that rank's values into the engine first."""
        engine, records = self._engine, self._records
        assert engine is not None
        values = [rec.param.data.detach().cpu() for rec in records]
        for rec, stub in zip(records, self._stubs, strict=True):
            rec.param.data = stub
        self._stubs = []
        if not ok or self.modifier_rank is None:
            return
        if engine.comm.world_size > 1:
            values = engine.comm.broadcast_object(values, src=self.modifier_rank)
        engine.parts.coordinator.quiesce()  # no transfer may still read a home written here
        for rec, value in zip(records, values, strict=True):
            _set_weights(engine, rec, value)
            engine.parts.coordinator.refresh(rec)


def _set_weights(engine: Engine, rec: OffloadParam, value: torch.Tensor) -> None:
    """`rec`'s whole new weights -> this rank's shard of them, into the fp32 master (when
    trained) and the home."""
    if tuple(value.shape) != rec.shape:
        raise ValueError(
            f"GatheredParameters: {rec.name!r} is {list(value.shape)} at the end of the "
            f"block, it was {list(rec.shape)}; write into the parameter in place (copy_, "
            "fill_), never replace it with a tensor of another shape"
        )
    lo, hi = rec.span
    shard = torch.zeros(rec.home.numel, dtype=torch.float32)
    shard[: hi - lo] = value.reshape(-1)[lo:hi].float()
    if rec.slot is not None:
        engine.parts.optimizer.set_masters(rec.slot, shard)
    rec.home.write(shard.to(rec.dtype))
