"""What the engine would allocate and move for one model and config, in bytes (one rank's).

Every term calls the function the engine sizes the same thing with: the optimizer's flat
layout over one rank's shards (`optimizer_layout`, `shard_of`), each tier's `Footprint`
(`grad_footprint`, `nvme_state_footprint`, `host_state_footprint`, `weights_footprint`,
`param_pool_nbytes`), which frozen homes stay in RAM (`frozen_nvme_mask`) and the
persistence rule (`persistent_flags`); parameter reads run the coordinator's planner
(`infinity.estimate.param_traffic`), gradient transfers the NVMe gradient tier's
(`infinity.estimate.grad_traffic`). The byte counts match `engine.memory_stats()` exactly;
nothing here allocates or measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infinity.config import ResolvedConfig, ZeroConfig
from infinity.estimate.grad_traffic import GradTraffic, grad_traffic
from infinity.estimate.param_traffic import Replay, replayed
from infinity.estimate.shapes import ModelShape
from infinity.swap.footprint import Footprint
from infinity.swap.grad_device import device_grad_bytes
from infinity.swap.grad_half import keeps_half
from infinity.swap.grad_plan import grad_footprint
from infinity.swap.nvme_state import nvme_state_footprint, state_buffers, state_nbytes
from infinity.swap.pool import param_pool_nbytes
from infinity.swap.split_state import grad_split, state_in_ram
from infinity.swap.state_tier import StateFormat, host_state_footprint
from infinity.swap.store import reserved_nbytes
from infinity.zero import communication_dtype, model_dtype
from infinity.zero.grad_reduce import pooled_bucket_nbytes
from infinity.zero.optimizer_state import state_format
from infinity.zero.overlap import ahead_nbytes, overlap_sub_groups
from infinity.zero.param import frozen_nvme_mask
from infinity.zero.shard import shard_align, shard_of
from infinity.zero.sub_groups import FlatLayout, optimizer_layout
from infinity.zero.weights import aliases_state, weights_footprint


@dataclass(frozen=True, slots=True)
class Sizes:
    """Bytes of one rank's run: resident, on disk, and moved per micro step or per step."""

    grad_host_bytes: int
    """fp32 gradient sums in host memory: one flat buffer, or with the optimizer on
    NVMe the gradient tier's `GRAD_BUFFERS` sub-group buffers."""
    weights_host_bytes: int
    """The trainable weights' host copy (0 when they alias the fp32 masters; the staging
    ring with parameters on NVMe)."""
    state_host_bytes: int
    """fp32 master + Adam moments in host memory (the cpu tier, or the sub-groups
    `offload_optimizer.max_in_cpu` keeps there) and the NVMe pipeline's buffers."""
    state_buffer_bytes: int
    """Of `state_host_bytes`, the NVMe pipeline's buffers."""
    frozen_host_bytes: int
    param_pool_bytes: int
    """The parameter staging pool (NVMe parameter tier only)."""
    overlap_host_bytes: int
    """The overlapped step's state copies and new-weight buffers (`offload_optimizer.
    overlap_step`; see [Note: the overlapped step's copies] in infinity/zero/overlap.py)."""
    host_bytes: int
    """The sum above: `memory_stats()["host_bytes"]`."""
    pinned_bytes: int
    optim_nvme_bytes: int
    param_nvme_bytes: int
    frozen_nvme_bytes: int
    """Of `param_nvme_bytes`, the frozen parameters' extents."""
    grad_nvme_bytes: int
    """fp32 gradient extents on NVMe (optimizer on NVMe only)."""
    grad_read_bytes_per_step: int
    """Gradient reads from NVMe in one optimizer step (all its micro-steps)."""
    grad_write_bytes_per_step: int
    grad_step_read_bytes: int
    """Of `grad_read_bytes_per_step`, what the optimizer step reads (the rest, backward)."""
    grad_waited_read_bytes_per_step: int
    """Of the gradient reads in backward, those backward waits for (sub-groups loaded back
    into a buffer, rows added to on disk: see infinity/estimate/grad_traffic.py)."""
    grad_waited_write_bytes_per_step: int
    """Of the gradient writes, those backward waits for (a sub-group's write before it is
    read back, the rows added to on disk)."""
    optim_read_bytes_per_step: int
    optim_ahead_read_bytes: int
    """Of `optim_read_bytes_per_step`, the first sub-groups the end of a sweep reads ahead
    into the free pipeline buffers: they land during the next forward and backward."""
    optim_write_bytes_per_step: int
    param_write_bytes_per_step: int
    """New 16-bit weights the optimizer writes to the NVMe parameter tier."""
    param_read_bytes_per_micro_step: int
    """Parameter reads from NVMe in one forward + backward (steady state)."""
    gather_bytes_per_micro_step: int
    """Home -> device copies of parameters in one forward + backward."""
    grad_offload_bytes_per_micro_step: int
    """Device -> host gradient copies (model dtype) in one backward (none for the gradients
    whose sums are kept on the device)."""
    grad_device_bytes: int
    """fp32 gradient sums kept on the device across micro batches
    (`offload_optimizer.gradients_on_device`)."""
    grad_step_copy_bytes: int
    """Device -> host copies of those sums at each optimizer step: once for the norm, once
    for CPU-Adam."""
    refresh_bytes_per_step: int
    """New weights copied into the gathered persistent trainable parameters at each
    optimizer step (none where those alias their host homes: the CPU device)."""
    peak_live_numel: int
    """Gathered parameter elements at most (non-persistent within the budget, plus every
    persistent one), the kept ones apart."""
    trainable_numel: int
    flat_numel: int
    """Elements of the optimizer's flat space (alignment padding included)."""
    num_sub_groups: int
    itemsize: int
    kept_device_bytes: int = 0
    """Trainable weights kept gathered on the device across the micro batches of a step
    (`zero_optimization.keep_weights_numel`; the coordinator's `peak_kept_param_numel`)."""
    kept_read_bytes_per_step: int = 0
    """NVMe reads of the kept weights: once a step, by its first micro batch (not in
    `param_read_bytes_per_micro_step`, which is every other micro batch's)."""
    kept_gather_bytes_per_step: int = 0
    """Home -> device copies of the kept weights, once a step (likewise)."""
    ahead_numels: tuple[int, ...] = ()
    """Elements of each sub-group the overlapped step may step during the last backward, in
    the order it would (the first ones backward finishes)."""
    grad_bucket_device_bytes: int = 0
    """With several ranks, the gradient buckets' pooled buffers on the device, in the
    communication dtype (`pooled_bucket_nbytes`; memory_stats' `grad_bucket_bytes`)."""
    reduce_scatter_bytes_per_micro_step: int = 0
    """With several ranks, the bytes one backward reduce-scatters: W rows of every
    trainable shard, in the communication dtype (`comm_reduce_scatter_bytes`)."""

    @property
    def nvme_bytes(self) -> int:
        return self.optim_nvme_bytes + self.param_nvme_bytes + self.grad_nvme_bytes

    def param_read_bytes_per_step(self, accum: int) -> int:
        """Parameter reads from NVMe in one optimizer step of `accum` micro batches."""
        return accum * self.param_read_bytes_per_micro_step + self.kept_read_bytes_per_step

    def host_device_bytes_per_step(self, accum: int) -> int:
        """Host <-> device copies in one optimizer step of `accum` micro batches: gathers
        and gradients at every micro batch, the kept weights once, the step's copies."""
        micro = self.gather_bytes_per_micro_step + self.grad_offload_bytes_per_micro_step
        step = self.refresh_bytes_per_step + self.grad_step_copy_bytes
        return accum * micro + self.kept_gather_bytes_per_step + step


def home_numels(shape: ModelShape, world_size: int = 1, align: int = 1) -> list[int]:
    """Elements of each parameter's home on one rank: its shard (`shard_of`, the engine's
    rule, `align` its `shard_align`; every rank's shard has the same size, padding
    included)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return [shard_of(p.numel, world_size, 0, align).numel for p in shape.params]


def layout_of(shape: ModelShape, config: ResolvedConfig, world_size: int = 1) -> FlatLayout:
    """One rank's optimizer flat space over its shards of the trainable parameters, in
    record order (`optimizer_layout`, as the engine builds it)."""
    homes = home_numels(shape, world_size, shard_align(config.optimizer.eight_bit))
    numels = [n for n, p in zip(homes, shape.params, strict=True) if p.trainable]
    return optimizer_layout(numels, config.zero_optimization)


def sizes(
    shape: ModelShape,
    config: ResolvedConfig,
    *,
    pins: bool,
    grads_spill: bool | None = None,
    checkpointing: bool = False,
    aliases: bool | None = None,
    world_size: int = 1,
) -> Sizes:
    """Every byte term for `shape` under a resolved `config`; `pins`: the device's host
    memory can be pinned (a GPU; the CPU device never pins). `grads_spill`: the fp32
    gradients go to NVMe per sub-group (default: as the engine decides, `gradients_spill`;
    False replays older runs). `checkpointing`: activation checkpointing, which changes
    the order backward gathers in. `aliases`: gathers from host homes alias them instead of
    copying (default: on the CPU device, as the engine does; False: older runs).
    `world_size`: the ranks sharing the parameters (every byte is one rank's)."""
    zero, dtype = config.zero_optimization, model_dtype(config)
    itemsize = dtype.itemsize
    homes = home_numels(shape, world_size, shard_align(config.optimizer.eight_bit))
    layout = layout_of(shape, config, world_size)
    state, ahead, buffers = _state(zero, layout.sub_group_numels, state_format(config.optimizer))
    optim_nvme, param_nvme = state.disk > 0, zero.offload_param.device == "nvme"
    keep = zero.offload_optimizer.gradients_in_cpu  # else they spill with the state
    spill = (optim_nvme and not keep) if grads_spill is None else grads_spill
    grad, grads, grad_device = _grads(shape, layout, config, spill, world_size)
    weights = weights_footprint(layout, dtype, nvme=param_nvme, state_on_host=not optim_nvme)
    early, overlap = _ahead(layout, config, spill, param_nvme=param_nvme, optim_nvme=optim_nvme)
    on_nvme = home_on_nvme(shape, zero)
    frozen = frozen_footprint(shape, on_nvme, itemsize, homes)
    pool = param_pool_bytes(shape, config, world_size) if param_nvme else 0
    pinned = _pinned(zero, pins, pool, buffers, weights.host + frozen.host)
    # Where gathers alias host homes, only NVMe reads copy ([Note: gathered means resident])
    copies = not (not pins if aliases is None else aliases)
    replay = replayed(shape, config, checkpointing=checkpointing)
    fetched = _fetched_bytes(shape, replay, homes, on_nvme, copies, itemsize)
    host = grad.host + weights.host + state.host + frozen.host + pool + overlap
    # The CPU device (it never pins) adds gradients straight into their fp32 sums.
    offloaded = _offloaded_numel(shape, layout, config) * itemsize if pins else 0
    return Sizes(
        grad_host_bytes=grad.host, weights_host_bytes=weights.host, state_host_bytes=state.host,
        state_buffer_bytes=buffers, frozen_host_bytes=frozen.host, param_pool_bytes=pool,
        overlap_host_bytes=overlap, host_bytes=host, pinned_bytes=pinned,
        optim_nvme_bytes=state.disk,
        param_nvme_bytes=weights.disk + frozen.disk, frozen_nvme_bytes=frozen.disk,
        grad_nvme_bytes=grad.disk, grad_read_bytes_per_step=grads.read,
        grad_write_bytes_per_step=grads.written, grad_step_read_bytes=grads.step_read,
        grad_waited_read_bytes_per_step=grads.backward_waited_read,
        grad_waited_write_bytes_per_step=grads.backward_waited_written,
        optim_read_bytes_per_step=state.disk, optim_ahead_read_bytes=ahead,
        optim_write_bytes_per_step=state.disk,
        param_write_bytes_per_step=layout.total * itemsize if param_nvme else 0,
        grad_offload_bytes_per_micro_step=offloaded,
        grad_device_bytes=grad_device, grad_step_copy_bytes=2 * grad_device,
        refresh_bytes_per_step=_refreshed(shape, zero) * itemsize if (param_nvme or copies) else 0,
        peak_live_numel=replay.peak_live_numel, **fetched,
        trainable_numel=shape.trainable_numel,
        flat_numel=layout.total, num_sub_groups=layout.num_sub_groups, itemsize=itemsize,
        ahead_numels=tuple(early), **_buckets(shape, homes, layout, config, world_size),
    )  # fmt: skip


def _buckets(
    shape: ModelShape, homes: Sequence[int], layout: FlatLayout, config: ResolvedConfig, world: int
) -> dict[str, int]:
    """The device bytes of the gradient buckets and the bytes one backward reduce-scatters
    with `world` ranks, by `GradReducer`'s rules, in the communication dtype (none on one
    rank); keyed as `Sizes`' fields."""
    if world < 2:
        return {}
    zero, itemsize = config.zero_optimization, communication_dtype(config).itemsize
    shards = [h for p, h in zip(shape.params, homes, strict=True) if p.trainable]
    pooled = pooled_bucket_nbytes(
        shards, world, zero.reduce_bucket_size, layout.total,
        overlap=zero.overlap_comm, contiguous=zero.contiguous_gradients, itemsize=itemsize,
    )  # fmt: skip
    return {
        "grad_bucket_device_bytes": pooled,
        "reduce_scatter_bytes_per_micro_step": world * sum(shards) * itemsize,
    }


def _ahead(
    layout: FlatLayout, config: ResolvedConfig, spill: bool, *, param_nvme: bool, optim_nvme: bool
) -> tuple[list[int], int]:
    """(elements of each sub-group the overlapped step may step early, the host bytes of
    their copies): `overlap_sub_groups` and `ahead_nbytes`, the engine's rules, with the
    gradient sums in host memory by `grad_split` and the weights aliasing the masters by
    `aliases_state`."""
    numels = layout.sub_group_numels
    on_device, first = grad_split(numels, config.zero_optimization.offload_optimizer)
    first = first if spill else len(numels)
    on_host = [on_device <= g < first for g in range(len(numels))]
    plan = overlap_sub_groups(config.zero_optimization, numels, on_host)
    early = [numels[g] for g in plan[0][: plan[1]]] if plan else []
    dtype = model_dtype(config)
    aliased = not param_nvme and aliases_state(dtype, state_on_host=not optim_nvme)
    return early, ahead_nbytes(early, state_format(config.optimizer), dtype.itemsize, aliased)


def _grads(
    shape: ModelShape, layout: FlatLayout, config: ResolvedConfig, spill: bool, world_size: int = 1
) -> tuple[Footprint, GradTraffic, int]:
    """The gradient tier's host and disk footprint, its NVMe traffic and the device bytes of
    the sums kept there: by `grad_split`, the first sub-groups on the device (with one host
    buffer the step reads them into), the next in host memory, the rest spilled through the
    NVMe tier when `spill`; all in host memory, in 16 bits when the engine keeps them so
    (`keeps_half`)."""
    numels = layout.sub_group_numels
    on_device, first = grad_split(numels, config.zero_optimization.offload_optimizer)
    first = first if spill else len(numels)
    device, host = device_grad_bytes(numels[:on_device]) if on_device else (0, 0)
    host += grad_footprint(numels[on_device:first], nvme=False).host
    if first == len(numels):
        half = config.zero_optimization.offload_optimizer.half_gradients
        accum = config.gradient_accumulation_steps
        if not on_device and keeps_half(half, accum, model_dtype(config), world_size):
            host //= 2
        return Footprint(host), GradTraffic(0, 0, 0), device
    nvme = grad_footprint(numels[first:], nvme=True)
    accum = config.gradient_accumulation_steps
    traffic = grad_traffic(shape, layout, accum, first)
    return Footprint(host + nvme.host, nvme.disk), traffic, device


def _offloaded_numel(shape: ModelShape, layout: FlatLayout, config: ResolvedConfig) -> int:
    """Elements of the gradients backward copies to the host: those of every trainable
    parameter whose sums are not all kept on the device (`FlatLayout.slots_within`)."""
    on_device, _ = grad_split(layout.sub_group_numels, config.zero_optimization.offload_optimizer)
    kept = layout.slots_within(on_device)
    trainable = [p for p in shape.params if p.trainable]
    return sum(p.numel for i, p in enumerate(trainable) if i not in kept)


def _refreshed(shape: ModelShape, zero: ZeroConfig) -> int:
    """Elements of trainable parameters that stay gathered (persistent): after each step the
    new weights are copied to them."""
    kept = zip(shape.params, shape.persistent(zero), strict=True)
    return sum(p.numel for p, keep in kept if keep and p.trainable)


def _pinned(zero: ZeroConfig, pins: bool, pool: int, buffers: int, homes: int) -> int:
    """Pinned host bytes: the parameter homes in host memory (`homes`: the 16-bit weight
    buffer and frozen homes; fp32 masters that are also the weights stay pageable) or
    the NVMe parameter pool, and the NVMe state pipeline's `buffers` when asked."""
    if not pins:
        return 0
    pinned = 0
    if zero.offload_param.pin_memory:
        pinned = pool if zero.offload_param.device == "nvme" else homes
    if zero.offload_optimizer.pin_memory:
        pinned += buffers
    return pinned


def _fetched_bytes(
    shape: ModelShape,
    replay: Replay,
    homes: Sequence[int],
    on_nvme: Sequence[bool],
    copies: bool,
    itemsize: int,
) -> dict[str, int]:
    """The parameter reads from NVMe and copies to the device the live-set planner decides
    over the model's trace: those of a micro batch, and the kept weights' once a step (as
    any fetch, but by the step's first micro batch only); with the kept weights' bytes on
    the device. Keyed as `Sizes`' fields."""
    numel = [p.numel for p in shape.params]
    # (parameter, elements gathered) of a micro batch's fetches, then of the kept weights
    micro = [(f.param, f.numel) for f in replay.fetches]
    kept = [(i, numel[i]) for i in replay.kept]

    def read(fetched: list[tuple[int, int]]) -> int:
        return sum(homes[i] for i, _ in fetched if on_nvme[i]) * itemsize

    def copied(fetched: list[tuple[int, int]]) -> int:
        return sum(n for i, n in fetched if copies or on_nvme[i]) * itemsize

    return {
        "param_read_bytes_per_micro_step": read(micro),
        "gather_bytes_per_micro_step": copied(micro),
        "kept_device_bytes": sum(n for _, n in kept) * itemsize,
        "kept_read_bytes_per_step": read(kept),
        "kept_gather_bytes_per_step": copied(kept),
    }


def _state(
    zero: ZeroConfig, sub_groups: Sequence[int], fmt: StateFormat
) -> tuple[Footprint, int, int]:
    """The optimizer-state tier's footprint (the sub-groups `state_in_ram` keeps in host
    memory, the rest on NVMe), the bytes the end of a sweep reads ahead (NvmeStateTier's
    prefetch_next_sweep: every buffer is free when a sweep ends), and the NVMe pipeline's
    host buffers (of the footprint's host bytes); the state is of format `fmt` (32-bit or
    8-bit moments)."""
    in_ram = state_in_ram(sub_groups, zero.offload_optimizer)
    host = host_state_footprint(sub_groups[:in_ram], fmt)
    on_nvme = sub_groups[in_ram:]
    if not on_nvme:
        return host, 0, 0
    buffer_count = zero.offload_optimizer.buffer_count
    count, _ = state_buffers(on_nvme, buffer_count, fmt)
    extents = [reserved_nbytes(state_nbytes(n, fmt)) for n in on_nvme]
    ahead = sum(extents[:count]) if zero.offload_optimizer.pipeline_read else 0
    nvme = nvme_state_footprint(on_nvme, buffer_count, fmt)
    return Footprint(host.host + nvme.host, nvme.disk), ahead, nvme.host


# -- where frozen parameters live ------------------------------------------------------------


def home_on_nvme(shape: ModelShape, zero: ZeroConfig) -> list[bool]:
    """Per parameter, whether its home is on NVMe: with the parameter tier there, every
    trainable one and the frozen ones past `offload_param.max_in_cpu` (`frozen_nvme_mask`,
    the engine's rule)."""
    if zero.offload_param.device != "nvme":
        return [False] * len(shape.params)
    numels = [p.numel for p in shape.params]
    trainable = [p.trainable for p in shape.params]
    frozen = frozen_nvme_mask(numels, trainable, zero.offload_param.max_in_cpu)
    return [t or f for t, f in zip(trainable, frozen, strict=True)]


def frozen_footprint(
    shape: ModelShape, on_nvme: Sequence[bool], itemsize: int, homes: Sequence[int]
) -> Footprint:
    """Frozen parameters' homes (`homes` elements each): a host buffer each, or an
    extent each on NVMe."""
    pairs = zip(shape.params, on_nvme, homes, strict=True)
    frozen = [(n * itemsize, on) for p, on, n in pairs if not p.trainable]
    return Footprint(
        sum(n for n, on in frozen if not on), sum(reserved_nbytes(n) for n, on in frozen if on)
    )


# -- the parameter tier ------------------------------------------------------------------------


def param_pool_bytes(shape: ModelShape, config: ResolvedConfig, world_size: int = 1) -> int:
    """The NVMe parameter staging pool, sized for the homes (one rank's shards)."""
    element_size = model_dtype(config).itemsize
    param = config.zero_optimization.offload_param
    return param_pool_nbytes(
        param,
        element_size=element_size,
        numels=home_numels(shape, world_size, shard_align(config.optimizer.eight_bit)),
    )
