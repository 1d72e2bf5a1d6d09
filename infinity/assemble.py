"""One place that assembles an engine's partitioned model, top-down in an explicit order.

Owns the construction order and the wiring between the parts, not any part's behaviour nor
the training loop (the engine's). `run_facts` gives `infinity.config.resolve_run` what it
settles the config for (the model's sizes and the ranks); `assemble` then builds each step
from the ones before it only:

0. the model checked: something to train, `no_decay` names that exist, and with several
   ranks the same weights on every rank;
1. the tiers: the swap stores, the NVMe parameter tier (frozen parameters laid out one
   extent each), the flat layout of the trainable slots (computed once, here) and the
   optimizer's state tier;
2. the weight output over that layout, with the disk's flat extent laid out first by an
   explicit call (`lay_out_flat`);
3. the records with their homes (`HomePlan`, `partition_model`);
4. the gradient tier and the optimizer, which writes the trainable weights into their homes
   from the build partitions (they go no further);
5. the coordinator, with the optimizer's new weights wired straight down to it
   (`GatheredRefresh`);
6. the backward entry, the module hooks, the gradient reducer and the gradient hooks.

It returns one `PartitionedModel` that owns all of them and closes them (`close`), each even
if an earlier one fails; a build that fails closes what it had opened.

[Note: gathered weights after a step] Trainable parameters that stay gathered between
iterations (persistent ones) must see each step's new weights. On both tiers they take them
from the optimizer's new weights while its sweep holds them (`on_new_weights`, wired to
`GatheredRefresh`, then the coordinator's `refresh`), not from their homes after the step:
on the NVMe tier the disk is then busy with the next sweep's read-ahead, and small reads
queued behind it took 13 ms each (0.35 s per step for 27 parameters at 507M); on the host
tier the values are still in cache. Anything in flight lands before the step
(`Coordinator.quiesce`), so every gathered copy is LIVE when the sweep reaches it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from infinity.accelerator import Accelerator
from infinity.comm import Comm
from infinity.config import Config, RunFacts
from infinity.optim.groups import ParamGroup
from infinity.swap import (
    NvmeParamTier,
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
    ModuleUnit,
    OffloadParam,
    ParamState,
    PartitionedOptimizer,
    Slot,
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

__all__ = ["GatheredRefresh", "PartitionedModel", "assemble", "run_facts"]


def run_facts(model: nn.Module, comm: Comm) -> RunFacts:
    """What `config.resolve_run` needs to resolve the config for `model` on `comm`'s ranks,
    as this local rank runs it (the estimate resolves through the same function)."""
    numels = tuple(p.numel() for p in model.parameters())
    return RunFacts(
        world_size=comm.world_size, param_numels=numels, resident=True, local_rank=comm.local_rank
    )


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


@dataclass(eq=False)
class PartitionedModel:
    """Everything `assemble` built for one model, and their `close()`."""

    module: nn.Module
    config: Config
    comm: Comm
    accelerator: Accelerator
    swap_stores: SwapStores
    param_tier: NvmeParamTier | None
    records: list[OffloadParam] = field(default_factory=list)
    optimizer: PartitionedOptimizer | None = None
    coordinator: Coordinator | None = None
    entry: BackwardEntry | None = None
    hooks: ModelHooks | None = None
    grad_reducer: GradReducer | None = None
    grad_offload: GradOffload | None = None
    grad_handles: list = field(default_factory=list)
    startup_s: dict[str, float] = field(default_factory=dict)
    """Seconds `assemble` spent in each step (check, tiers, partition, optimizer, runtime)."""

    def memory_stats(self) -> dict[str, int]:
        """See `Engine.memory_stats`."""
        stats = self.coordinator.stats()
        # Trainable homes are the optimizer's buffers (it counts them, or they alias its fp32
        # masters); frozen ones are only ours.
        host = sum(r.home.host_bytes for r in self.records if not r.trainable)
        optim = self.optimizer.memory_stats()
        stats["host_bytes"] = host + optim["host_bytes"]
        prefixes = ("nvme_", "optim_host_buffer", "optim_overlap", "grad_")
        stats.update({k: v for k, v in optim.items() if k.startswith(prefixes)})
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
        stats["rank"], stats["world_size"] = self.comm.rank, self.comm.world_size
        stats["home_numel"] = sum(r.home.numel for r in self.records)  # this rank's shards
        stats.update(self.comm.stats())
        if self.grad_reducer is not None:
            stats.update(self.grad_reducer.memory_stats())
        return stats

    def close(self) -> None:
        """Remove the hooks, release what is gathered, close the optimizer's tiers, the
        parameter tier and the swap stores under them, each even if an earlier one fails."""
        if self.hooks is not None:
            self.hooks.remove()
        for handle in self.grad_handles:
            handle.remove()
        self.grad_handles = []
        try:
            if self.coordinator is not None:
                self.coordinator.abort()
                self.accelerator.empty_cache()
        finally:
            self.close_stores()

    def close_stores(self) -> None:
        """Close the optimizer's state and gradient tiers (if built), the parameter tier,
        then the swap stores under them, each even if an earlier one fails."""
        try:
            if self.optimizer is not None:
                try:
                    try:
                        self.optimizer.cancel_ahead()  # no step follows
                    finally:
                        self.optimizer.store.close()
                finally:
                    self.optimizer.grads.close()
        finally:
            try:
                if self.param_tier is not None:
                    self.param_tier.close()
            finally:
                self.swap_stores.close()


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
    parts = PartitionedModel(
        model, config, comm, accelerator, SwapStores(rank=comm.rank), param_tier=None
    )
    parts.startup_s = clock.seconds
    clock.lap("check")
    try:
        plan, state_tier = _tiers(parts, named, trainable)
        clock.lap("tiers")
        parts.records, units, sources = partition_model(model, config, accelerator, plan)
        clock.lap("partition")
        _optimizer(parts, plan, state_tier, trainable, sources, no_decay, groups)
        del sources  # the optimizer has written them into their homes
        clock.lap("optimizer")
        _runtime(parts, units, timer, loss_scale)
        clock.lap("runtime")
    except BaseException:  # no swap directory or lock outlives a failed start
        parts.close()
        raise
    return parts


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
    parts: PartitionedModel,
    named: list[tuple[str, nn.Parameter]],
    trainable: list[tuple[str, int]],
):
    """Steps 1 and 2: the tiers, the flat layout (once), the weight output over it; returns
    the homes' plan and the optimizer's state tier."""
    config, comm = parts.config, parts.comm
    zero = config.zero_optimization
    dtype = model_dtype(config)
    names = [n for n, _ in trainable]
    on_nvme: set[str] = set()
    if zero.offload_param.device == "nvme":
        on_nvme = frozen_on_nvme(named, zero.offload_param)
        parts.param_tier = _param_tier(parts, named, on_nvme, dtype)
    layout = optimizer_layout([n for _, n in trainable], zero)
    state_tier = make_state_tier(
        layout.sub_group_numels,
        zero.offload_optimizer,
        config.aio,
        stores=parts.swap_stores,
        fmt=state_format(config.optimizer),
    )
    if parts.param_tier is not None:
        lay_out_flat(parts.param_tier, layout, names, dtype)
    pin = parts.accelerator if zero.offload_param.pin_memory else None
    weights = make_weights(
        layout, names, dtype, state_tier=state_tier, param_tier=parts.param_tier, pin=pin
    )
    plan = HomePlan(
        weights,
        {n: i for i, n in enumerate(names)},
        parts.param_tier,
        frozenset(on_nvme),
        comm=comm if comm.world_size > 1 else None,
        align=shard_align(parts.config.optimizer.eight_bit),
    )
    return plan, state_tier


def _param_tier(
    parts: PartitionedModel,
    named: list[tuple[str, nn.Parameter]],
    on_nvme: set[str],
    dtype: torch.dtype,
) -> NvmeParamTier:
    """The NVMe parameter tier: frozen parameters laid out one extent each (the trainable
    ones are laid out in the flat extent by `lay_out_flat`); this rank's shards of them."""
    zero = parts.config.zero_optimization
    align = shard_align(parts.config.optimizer.eight_bit)
    numels = [_shard_numel(p.numel(), parts.comm, align) for _, p in named]
    return make_param_tier(
        {n: (k, dtype) for (n, _), k in zip(named, numels, strict=True) if n in on_nvme},
        zero.offload_param,
        parts.config.aio,
        stores=parts.swap_stores,
        numels=numels,
        element_size=dtype.itemsize,
        # Prefetch never reads ahead more than the whole model: a bucket larger than the
        # model asks for no more buffers than the model has parameters to fill.
        prefetch_numel=min(zero.prefetch_bucket_size, sum(numels)),
    )


def _optimizer(
    parts: PartitionedModel,
    plan: HomePlan,
    state_tier,
    trainable: list[tuple[str, int]],
    sources: list[torch.Tensor],
    no_decay: Collection[str],
    groups: Sequence[ParamGroup],
) -> None:
    """Step 4: the gradient tier and the optimizer, over the layout the homes were made with."""
    config = parts.config
    zero = config.zero_optimization
    layout = plan.weights.layout
    names = [n for n, _ in trainable]
    slots = [Slot(n, k, src) for (n, k), src in zip(trainable, sources, strict=True)]
    grads = make_grad_tier(
        layout.sub_group_numels,
        zero.offload_optimizer,
        config.aio,
        stores=parts.swap_stores,
        accelerator=parts.accelerator,
        half_dtype=_half_gradients(parts, slots),
    )
    try:
        parts.optimizer = PartitionedOptimizer(
            slots,
            optimizer=config.optimizer,
            zero=zero,
            state_tier=state_tier,
            weights=plan.weights,
            no_decay=[i for i, n in enumerate(names) if n in no_decay],
            groups=groups,
            grad_tier=grads,
            comm=parts.comm,
        )
    except BaseException:
        try:
            state_tier.close()
        finally:
            grads.close()
        raise


def _runtime(
    parts: PartitionedModel,
    units: dict[nn.Module, ModuleUnit],
    timer: StepTimer,
    loss_scale: Callable[[], float] | None,
) -> None:
    """Steps 5 and 6: the coordinator (the optimizer's new weights wired down to it), the
    backward entry, the hooks, the gradient reducer or offload and the gradient hooks."""
    zero = parts.config.zero_optimization
    optimizer, accel = parts.optimizer, parts.accelerator
    coord = parts.coordinator = Coordinator(parts.records, zero, accelerator=accel)
    trainable = [r for r in parts.records if r.trainable]
    optimizer.on_new_weights = GatheredRefresh(trainable, optimizer.layout, coord)
    optimizer.range = accel.range
    parts.entry = BackwardEntry(coord, loss_scale=loss_scale, timer=timer)
    by_param = {rec.param: rec for rec in parts.records}
    parts.hooks = ModelHooks(parts.module, units, by_param, coord, enter_backward=parts.entry.enter)
    on_device = optimizer.device_slots()  # their sums stay on the device
    if parts.comm.world_size > 1:  # buckets that reduce-scatter gradients into the slots
        parts.grad_reducer = GradReducer(
            parts.comm,
            optimizer.accumulate_grad,
            accel,
            bucket_numel=zero.reduce_bucket_size,
            overlap=zero.overlap_comm,
            contiguous=zero.contiguous_gradients,
            total_shard_numel=optimizer.layout.total,
            align=shard_align(parts.config.optimizer.eight_bit),
            on_device=on_device,
        )
    parts.grad_offload = GradOffload(optimizer.accumulate_grad, accel, on_device=on_device)
    parts.grad_handles = install_grad_hooks(
        parts.records, parts.grad_offload.add, parts.hooks, accel, parts.grad_reducer
    )


def _half_gradients(parts: PartitionedModel, slots: list[Slot]) -> torch.dtype | None:
    """The 16-bit dtype the gradients are kept in, if they are (`keeps_half`)."""
    config, dtype = parts.config, check_slots(slots)
    half = config.zero_optimization.offload_optimizer.half_gradients
    accum = config.gradient_accumulation_steps
    return dtype if keeps_half(half, accum, dtype, parts.comm.world_size) else None
