"""One place that assembles an engine's partitioned model, top-down in an explicit order.

Owns the construction order and the wiring between the parts, not any part's behaviour nor
the training loop (the engine's). `run_facts` gives `infinity.config.resolve_run` what it
settles the config for (the model's sizes and the ranks); `assemble` then builds each step
from the ones before it only, each part given what it calls at construction:

0. the model checked: something to train, `no_decay` names that exist, and with several
   ranks the same weights on every rank;
1. the tiers: the swap stores, the NVMe parameter tier (frozen parameters laid out one
   extent each), the flat layout of the trainable slots (computed once, here) and the
   optimizer's state tier;
2. the weight output over that layout, with the disk's flat extent laid out first by an
   explicit call (`lay_out_flat`);
3. the records with their homes (`HomePlan`, `partition_model`), and the coordinator over
   them;
4. the gradient tier and the optimizer, which writes the trainable weights into their homes
   from the build partitions (they go no further) and is given the coordinator's refresh
   for its new weights (`GatheredRefresh`);
5. the backward entry, the module hooks, the gradient reducer and the gradient hooks.

It returns one `PartitionedModel`, a built value: every part once, none set afterwards. Each
part that holds something (a hook, a lock, a file, a thread) registers its undoing on one
`contextlib.ExitStack` as soon as it is built, so a build that fails at any step closes
what it had opened, in reverse order, and `PartitionedModel.close` does the same for a
whole one (each even if an earlier one fails).

[Note: gathered weights after a step] Trainable parameters that stay gathered between
iterations (persistent ones) must see each step's new weights. On both tiers they take them
from the optimizer's new weights while its sweep holds them (`on_new_weights`, given
`GatheredRefresh`, then the coordinator's `refresh`), not from their homes after the step:
on the NVMe tier the disk is then busy with the next sweep's read-ahead, and small reads
queued behind it took 13 ms each (0.35 s per step for 27 parameters at 507M); on the host
tier the values are still in cache. Anything in flight lands before the step
(`Coordinator.quiesce`), so every gathered copy is LIVE when the sweep reaches it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from infinity.accelerator import Accelerator
from infinity.comm import Comm
from infinity.config import Config, ResolvedConfig, RunFacts, resolve_run, resolved_for
from infinity.optim.groups import ParamGroup
from infinity.swap import (
    NvmeParamTier,
    StateTier,
    SwapStores,
    make_grad_tier,
    make_param_tier,
    make_state_tier,
)
from infinity.swap.grad_half import keeps_half
from infinity.utils.phase_clock import PhaseClock
from infinity.utils.step_timer import StepTimer
from infinity.zero import (
    BackwardEntry,
    Coordinator,
    HomePlan,
    ModelHooks,
    OffloadParam,
    ParamState,
    PartitionedOptimizer,
    Slot,
    communication_dtype,
    frozen_on_nvme,
    install_grad_hooks,
    make_weights,
    model_dtype,
    optimizer_layout,
    partition_model,
)
from infinity.zero.grad_offload import GradOffload
from infinity.zero.grad_reduce import GradReducer
from infinity.zero.optimizer_state import state_format
from infinity.zero.shard import check_same_weights, shard_align, shard_of
from infinity.zero.sub_groups import FlatLayout, check_slots
from infinity.zero.weights import lay_out_flat

__all__ = ["GatheredRefresh", "PartitionedModel", "assemble", "run_config", "run_facts"]


def run_facts(model: nn.Module, comm: Comm) -> RunFacts:
    """What `config.resolve_run` needs to resolve the config for `model` on `comm`'s ranks,
    as this local rank runs it (the estimate resolves through the same function)."""
    numels = tuple(p.numel() for p in model.parameters())
    return RunFacts(
        world_size=comm.world_size, param_numels=numels, resident=True, local_rank=comm.local_rank
    )


def run_config(
    config: Config | dict | str | os.PathLike, model: nn.Module, comm: Comm
) -> ResolvedConfig:
    """The config `model` runs with on `comm`'s ranks: `config` as it is when it was resolved
    for exactly these facts (a training run resolves once and hands it over), else resolved
    here through `config.resolve_run`."""
    facts = run_facts(model, comm)
    return config if resolved_for(config, facts) else resolve_run(Config.load(config), facts)


class GatheredRefresh:
    """The optimizer's new weights of flat elements [start, start + numel), handed down to
    the trainable parameters that are gathered (see [Note: gathered weights after a step])."""

    def __init__(
        self, trainable: Sequence[OffloadParam], layout: FlatLayout, coordinator: Coordinator
    ) -> None:
        self.trainable = list(trainable)  # by slot: records are in model order, as the slots
        self.layout = layout
        self.coordinator = coordinator

    def __call__(self, start: int, weights: torch.Tensor) -> None:
        layout = self.layout
        refresh = self.coordinator.refresh
        for slot, a, b in layout.pieces(start // layout.sub_group_size):
            rec = self.trainable[slot]
            if rec.state is not ParamState.RELEASED:
                at = layout.offsets[slot] + a - start
                refresh(rec, weights[at : at + b - a], start=a)


@dataclass(frozen=True, eq=False, kw_only=True)
class PartitionedModel:
    """Everything `assemble` built for one model, each part once, and their `close()`."""

    records: list[OffloadParam]
    """One per parameter, in model order, each with its home."""
    param_tier: NvmeParamTier | None
    """The NVMe parameter tier (`offload_param.device` "nvme"), else None."""
    optimizer: PartitionedOptimizer
    coordinator: Coordinator
    entry: BackwardEntry
    hooks: ModelHooks
    grad_offload: GradOffload
    grad_reducer: GradReducer | None
    """With several ranks, the buckets that reduce-scatter gradients into the slots."""
    startup_s: dict[str, float]
    """Seconds `assemble` spent in each step (check, tiers, partition, optimizer, runtime)."""
    closing: ExitStack = field(repr=False)
    """Each part's undoing, registered as it was built: `close` runs them in reverse."""

    def memory_stats(self, comm: Comm) -> dict[str, int]:
        """See `Engine.memory_stats` (`comm`: the ranks the parts were built for)."""
        stats = self.coordinator.stats()
        # Trainable homes are the optimizer's buffers (it counts them, or they alias its fp32
        # masters); frozen ones are only ours.
        host = sum(r.home.host_bytes for r in self.records if not r.trainable)
        optim = self.optimizer.memory_stats()
        stats["host_bytes"] = host + optim["host_bytes"]
        prefixes = ("nvme_", "optim_host_buffer", "optim_overlap", "grad_")
        stats.update({k: v for k, v in optim.items() if k.startswith(prefixes)})
        stats["optim_state_bits"] = optim["optim_state_bits"]  # 8-bit or 32-bit moments
        # Pinned: the host homes (offload_param.pin_memory; the trainable ones are the
        # optimizer's weight buffer) and the NVMe pipelines' buffers.
        homes = sum(r.home.pinned_bytes for r in self.records if not r.trainable)
        homes += self.optimizer.weights.pinned_bytes
        buffers = optim.get("optim_host_buffer_pinned_bytes", 0)  # offload_optimizer.pin_memory
        pinned = homes + buffers
        peak_pinned = homes + (optim.get("optim_host_buffer_peak_bytes", 0) if buffers else 0)
        if self.param_tier is not None:
            stats.update(self.param_tier.memory_stats())
            pool = self.param_tier.pool
            stats["host_bytes"] += pool.total_bytes
            if pool.pinned:
                pinned += pool.total_bytes
                peak_pinned += pool.peak_bytes_in_use
        stats["pinned_bytes"], stats["peak_pinned_bytes"] = pinned, peak_pinned
        stats["rank"], stats["world_size"] = comm.rank, comm.world_size
        stats["home_numel"] = sum(r.home.numel for r in self.records)  # this rank's shards
        stats.update(comm.stats())
        if self.grad_reducer is not None:
            stats.update(self.grad_reducer.memory_stats())
        return stats

    def close(self) -> None:
        """Undo the build in reverse: remove the gradient and module hooks, stop a step
        begun ahead, close the gradient tier, release what is gathered, close the state
        tier, the parameter tier and the swap stores under them, each even if an earlier one
        fails. Idempotent."""
        self.closing.close()


class _Build(NamedTuple):
    """What every step of a build reads, and the stack each registers its undoing on."""

    config: Config
    comm: Comm
    accelerator: Accelerator
    closing: ExitStack


class _Tiers(NamedTuple):
    """Steps 1 and 2: where the parts' bytes will live."""

    stores: SwapStores
    param_tier: NvmeParamTier | None
    state_tier: StateTier
    plan: HomePlan
    """The homes' plan, over the weight output (`plan.weights`) and its flat layout."""


def assemble(
    model: nn.Module,
    config: Config,
    *,
    comm: Comm,
    accelerator: Accelerator,
    no_decay: Collection[str],
    groups: Sequence[ParamGroup] = (),
    timer: StepTimer,
    loss_scale: Callable[[], float] | None,
) -> PartitionedModel:
    """Partition `model` under the resolved `config` and build what trains it, in the order
    the module's docstring gives. `loss_scale` returns the fp16 loss scale (None: none);
    `timer` times plain backwards."""
    clock = PhaseClock()
    if comm.world_size > 1:
        check_same_weights(model.named_parameters(), comm)
    named = list(model.named_parameters())
    align = shard_align(config.optimizer.eight_bit)
    trainable = [(n, _shard_numel(p.numel(), comm, align)) for n, p in named if p.requires_grad]
    _check_names(named, trainable, set(no_decay).union(*(g.names for g in groups)))
    clock.lap("check")
    with ExitStack() as closing:  # a step that raises closes what the earlier ones opened
        build = _Build(config, comm, accelerator, closing)
        tiers = _tiers(build, named, trainable)
        clock.lap("tiers")
        records, units, sources = partition_model(model, config, accelerator, tiers.plan)
        coordinator = Coordinator(records, config.zero_optimization, accelerator=accelerator)
        closing.callback(_release_all, coordinator, accelerator)
        clock.lap("partition")
        by_slot = [r for r in records if r.trainable]  # model order is the slots' order
        refresh = GatheredRefresh(by_slot, tiers.plan.weights.layout, coordinator)
        optimizer = _optimizer(build, tiers, trainable, sources, no_decay, groups, refresh)
        del sources  # the optimizer has written them into their homes
        clock.lap("optimizer")
        entry = BackwardEntry(coordinator, loss_scale=loss_scale, timer=timer)
        by_param = {rec.param: rec for rec in records}
        hooks = ModelHooks(model, units, by_param, coordinator, enter_backward=entry.enter)
        closing.callback(hooks.remove)
        grad_offload, grad_reducer = _grad_hooks(build, records, optimizer, hooks)
        clock.lap("runtime")
        return PartitionedModel(
            records=records, param_tier=tiers.param_tier, optimizer=optimizer,
            coordinator=coordinator, entry=entry, hooks=hooks, grad_offload=grad_offload,
            grad_reducer=grad_reducer, startup_s=clock.seconds, closing=closing.pop_all(),
        )  # fmt: skip


def _release_all(coordinator: Coordinator, accelerator: Accelerator) -> None:
    """Release what is gathered (from any phase) and give the device's cache back."""
    coordinator.abort()
    accelerator.empty_cache()


def _check_names(
    named: list[tuple[str, nn.Parameter]],
    trainable: list[tuple[str, int]],
    no_decay: Collection[str],
) -> None:
    if not trainable:
        raise ValueError(
            "initialize: the model has no parameter with requires_grad=True; nothing to train"
        )
    unknown = sorted(set(no_decay) - {n for n, _ in named})
    if unknown:
        raise ValueError(
            f"initialize: no_decay or group names {unknown[:5]}, which are not parameters of the "
            "model; use names from model.named_parameters()"
        )


def _shard_numel(numel: int, comm: Comm, align: int) -> int:
    """Elements of this rank's shard of a parameter (all of them with one rank)."""
    return shard_of(numel, comm.world_size, comm.rank, align).numel


def _tiers(
    build: _Build, named: list[tuple[str, nn.Parameter]], trainable: list[tuple[str, int]]
) -> _Tiers:
    """Steps 1 and 2: the tiers, the flat layout (once), the weight output over it."""
    config, comm, closing = build.config, build.comm, build.closing
    zero = config.zero_optimization
    stores = closing.enter_context(SwapStores(rank=comm.rank))
    dtype = model_dtype(config)
    names = [n for n, _ in trainable]
    on_nvme: set[str] = set()
    param_tier = None
    if zero.offload_param.device == "nvme":
        on_nvme = frozen_on_nvme(named, zero.offload_param)
        param_tier = _param_tier(build, stores, named, on_nvme, dtype)
        closing.callback(param_tier.close)
    layout = optimizer_layout([n for _, n in trainable], zero)
    state_tier = make_state_tier(
        layout.sub_group_numels,
        zero.offload_optimizer,
        config.aio,
        stores=stores,
        fmt=state_format(config.optimizer),
    )
    closing.callback(state_tier.close)
    if param_tier is not None:
        lay_out_flat(param_tier, layout, names, dtype)
    pin = build.accelerator if zero.offload_param.pin_memory else None
    weights = make_weights(
        layout, names, dtype, state_tier=state_tier, param_tier=param_tier, pin=pin
    )
    plan = HomePlan(
        weights,
        {n: i for i, n in enumerate(names)},
        param_tier,
        frozenset(on_nvme),
        comm=comm if comm.world_size > 1 else None,
        align=shard_align(config.optimizer.eight_bit),
    )
    return _Tiers(stores, param_tier, state_tier, plan)


def _param_tier(
    build: _Build,
    stores: SwapStores,
    named: list[tuple[str, nn.Parameter]],
    on_nvme: set[str],
    dtype: torch.dtype,
) -> NvmeParamTier:
    """The NVMe parameter tier: frozen parameters laid out one extent each (the trainable
    ones are laid out in the flat extent by `lay_out_flat`); this rank's shards of them."""
    zero = build.config.zero_optimization
    align = shard_align(build.config.optimizer.eight_bit)
    numels = [_shard_numel(p.numel(), build.comm, align) for _, p in named]
    return make_param_tier(
        {n: (k, dtype) for (n, _), k in zip(named, numels, strict=True) if n in on_nvme},
        zero.offload_param,
        build.config.aio,
        stores=stores,
        numels=numels,
        element_size=dtype.itemsize,
        # Prefetch never reads ahead more than the whole model: a bucket larger than the
        # model asks for no more buffers than the model has parameters to fill.
        prefetch_numel=min(zero.prefetch_bucket_size, sum(numels)),
    )


def _optimizer(
    build: _Build,
    tiers: _Tiers,
    trainable: list[tuple[str, int]],
    sources: list[torch.Tensor],
    no_decay: Collection[str],
    groups: Sequence[ParamGroup],
    on_new_weights: GatheredRefresh,
) -> PartitionedOptimizer:
    """Step 4: the gradient tier and the optimizer, over the layout the homes were made with."""
    config = build.config
    zero = config.zero_optimization
    layout = tiers.plan.weights.layout
    names = [n for n, _ in trainable]
    slots = [Slot(n, k, src) for (n, k), src in zip(trainable, sources, strict=True)]
    grads = make_grad_tier(
        layout.sub_group_numels,
        zero.offload_optimizer,
        config.aio,
        stores=tiers.stores,
        accelerator=build.accelerator,
        half_dtype=_half_gradients(config, build.comm, slots),
    )
    build.closing.callback(grads.close)
    optimizer = PartitionedOptimizer(
        slots,
        optimizer=config.optimizer,
        zero=zero,
        state_tier=tiers.state_tier,
        weights=tiers.plan.weights,
        no_decay=[i for i, n in enumerate(names) if n in no_decay],
        groups=groups,
        grad_tier=grads,
        comm=build.comm,
        on_new_weights=on_new_weights,
        profile_range=build.accelerator.range,
    )
    build.closing.callback(optimizer.cancel_ahead)  # no step follows
    return optimizer


def _grad_hooks(
    build: _Build, records: list[OffloadParam], optimizer: PartitionedOptimizer, hooks: ModelHooks
) -> tuple[GradOffload, GradReducer | None]:
    """Step 5's end: the gradient reducer (several ranks) or offload, and the gradient hooks
    that hand each gradient to them."""
    zero, comm, accel = build.config.zero_optimization, build.comm, build.accelerator
    on_device = optimizer.device_slots()  # their sums stay on the device
    grad_reducer = None
    if comm.world_size > 1:  # buckets that reduce-scatter gradients into the slots
        grad_reducer = GradReducer(
            comm,
            optimizer.accumulate_grad,
            accel,
            bucket_numel=zero.reduce_bucket_size,
            overlap=zero.overlap_comm,
            contiguous=zero.contiguous_gradients,
            total_shard_numel=optimizer.layout.total,
            align=shard_align(build.config.optimizer.eight_bit),
            on_device=on_device,
            dtype=communication_dtype(build.config),
        )
    grad_offload = GradOffload(optimizer.accumulate_grad, accel, on_device=on_device)
    handles = install_grad_hooks(records, grad_offload.add, hooks, accel, grad_reducer)
    build.closing.callback(_remove, handles)
    return grad_offload, grad_reducer


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _half_gradients(config: Config, comm: Comm, slots: list[Slot]) -> torch.dtype | None:
    """The 16-bit dtype the gradients are kept in, if they are (`keeps_half`)."""
    dtype = check_slots(slots)
    half = config.zero_optimization.offload_optimizer.half_gradients
    accum = config.gradient_accumulation_steps
    return dtype if keeps_half(half, accum, dtype, comm.world_size) else None
