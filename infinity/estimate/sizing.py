"""What the engine would allocate and move for one model and config, in bytes.

Every term calls the function the engine sizes the same thing with: the flat layout and its
sub-groups (`infinity.zero.sub_groups`), the swap store's extent padding
(`reserved_nbytes`), the NVMe state extents and pipeline buffers (`state_nbytes`,
`state_buffer_count`), the parameter staging pool (`param_buffer_numel`), the NVMe weight
ring (`staging_host_bytes`) and the persistence rule (`persistent_flags`); parameter reads
replay the coordinator's policy (`infinity.estimate.param_traffic`). The byte counts match
`engine.memory_stats()` exactly; nothing here allocates or measures.

Terms that depend on where fp32 gradients live and on frozen parameters are their own
functions (`grad_host_bytes`, `frozen_host_bytes`, `frozen_nvme_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity.config import Config
from infinity.estimate.grad_traffic import GradTraffic, grad_traffic
from infinity.estimate.param_traffic import param_reads_per_micro_step
from infinity.estimate.shapes import ModelShape
from infinity.swap.grad_store import grad_buffers
from infinity.swap.nvme_state import state_nbytes
from infinity.swap.pool import param_buffer_numel
from infinity.swap.store import align_up, reserved_nbytes
from infinity.swap.tiers import state_buffer_count
from infinity.zero import model_dtype
from infinity.zero.sub_groups import FlatLayout, flat_layout, resolve_sub_group_size
from infinity.zero.weights import staging_host_bytes

_F32 = 4


@dataclass(frozen=True, slots=True)
class Sizes:
    """Bytes of one rank's run: resident, on disk, and moved per micro step or per step."""

    grad_host_bytes: int
    """fp32 gradient partitions in host memory: one flat buffer, or with the optimizer on
    NVMe the grad store's `GRAD_BUFFERS` sub-group buffers."""
    weights_host_bytes: int
    """The trainable weights' host copy (0 when they alias the fp32 masters; the staging
    ring with parameters on NVMe)."""
    state_host_bytes: int
    """fp32 master + Adam moments in host memory (the cpu tier), or the NVMe pipeline's
    buffers."""
    frozen_host_bytes: int
    param_pool_bytes: int
    """The parameter staging pool (NVMe parameter tier only)."""
    host_bytes: int
    """The sum above: `memory_stats()["host_bytes"]`."""
    pinned_bytes: int
    optim_nvme_bytes: int
    param_nvme_bytes: int
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
    """Device -> host gradient copies (model dtype) in one backward."""
    refresh_bytes_per_step: int
    """New weights copied into the gathered persistent trainable parameters at each
    optimizer step (none where those alias their host homes: the CPU device)."""
    peak_live_numel: int
    """Gathered parameter elements at most (non-persistent within the budget, plus every
    persistent one)."""
    trainable_numel: int
    flat_numel: int
    """Elements of the optimizer's flat space (alignment padding included)."""
    num_sub_groups: int
    itemsize: int

    @property
    def nvme_bytes(self) -> int:
        return self.optim_nvme_bytes + self.param_nvme_bytes + self.grad_nvme_bytes


def resolve_config(config: Config, shape: ModelShape) -> Config:
    """The config as `infinity train` and the engine resolve it for this model."""
    if config.zero_optimization.stage != 3:
        raise ValueError(
            f"zero_optimization.stage is {config.zero_optimization.stage}: Infinity runs (and "
            "estimates) stage 3 only; set it to 3"
        )
    largest = max((p.numel for p in shape.params), default=1)
    return config.resolve(hidden_size=shape.dims.hidden_size, largest_param_numel=max(1, largest))


def layout_of(shape: ModelShape, config: Config) -> FlatLayout:
    """The optimizer's flat space of the trainable parameters, in record order."""
    numels = [p.numel for p in shape.params if p.trainable]
    return flat_layout(numels, resolve_sub_group_size(config.zero_optimization.sub_group_size))


def sizes(
    shape: ModelShape,
    config: Config,
    *,
    pins: bool,
    grads_spill: bool | None = None,
    checkpointing: bool = False,
    aliases: bool | None = None,
) -> Sizes:
    """Every byte term for `shape` under a resolved `config`; `pins`: the device's host
    memory can be pinned (a GPU; the CPU device never pins). `grads_spill`: the fp32
    gradients go to NVMe per sub-group (default: when the optimizer state does, as the
    engine does; False replays runs made before gradients could spill). `checkpointing`:
    activation checkpointing, which changes the order backward gathers in. `aliases`: gathers
    from host homes alias them instead of copying (default: on the CPU device, as the engine
    does; False replays runs made before they did)."""
    zero = config.zero_optimization
    dtype = model_dtype(config)
    itemsize = dtype.itemsize
    layout = layout_of(shape, config)
    sub_groups = layout.sub_group_numels
    optim_nvme = zero.offload_optimizer.device == "nvme"
    param_nvme = zero.offload_param.device == "nvme"
    spill = optim_nvme if grads_spill is None else grads_spill
    grad = grad_host_bytes(layout, nvme=spill)
    grad_disk = grad_nvme_bytes(layout) if spill else 0
    accum = int(config.gradient_accumulation_steps)
    grads = grad_traffic(shape, layout, accum) if spill else GradTraffic(0, 0, 0)
    if optim_nvme:
        extents = [reserved_nbytes(state_nbytes(n)) for n in sub_groups]
        optim_disk = sum(extents)
        buffer = align_up(max(extents, default=4096))
        buffers = state_buffer_count(zero.offload_optimizer, layout.num_sub_groups)
        state_host = buffers * buffer
        # NvmeStateStore's prefetch_next_sweep: every buffer is free when a sweep ends
        pipelined = zero.offload_optimizer.pipeline_read
        ahead = sum(extents[:buffers]) if pipelined else 0
    else:
        optim_disk, state_host, ahead = 0, 3 * _F32 * sum(sub_groups), 0
    if param_nvme:
        weights = staging_host_bytes(layout, dtype)
        pool = param_pool_bytes(shape, config)
        param_disk = reserved_nbytes(layout.total * itemsize) + frozen_nvme_bytes(shape, itemsize)
        param_write = layout.total * itemsize
        frozen_host = 0
    else:
        aliased = dtype == torch.float32 and not optim_nvme
        weights = 0 if aliased else layout.total * itemsize
        pool = param_disk = param_write = 0
        frozen_host = frozen_host_bytes(shape, itemsize)
    pool_pinned = pool if (pins and zero.offload_param.pin_memory) else 0
    if optim_nvme and pins and zero.offload_optimizer.pin_memory:
        pool_pinned += state_host  # the NVMe pipeline's buffers, pinned when asked
    gathered = param_reads_per_micro_step(shape, config, checkpointing=checkpointing)
    # Only reads from NVMe are copied where gathers alias host homes (see [Note: gathered
    # means resident] in infinity/zero/param.py).
    copied = param_nvme or not (not pins if aliases is None else aliases)
    kept = zip(shape.params, shape.persistent(zero), strict=True)
    refreshed = sum(p.numel for p, keep in kept if keep and p.trainable)
    return Sizes(
        grad_host_bytes=grad,
        weights_host_bytes=weights,
        state_host_bytes=state_host,
        frozen_host_bytes=frozen_host,
        param_pool_bytes=pool,
        host_bytes=grad + weights + state_host + frozen_host + pool,
        pinned_bytes=pool_pinned,
        optim_nvme_bytes=optim_disk,
        param_nvme_bytes=param_disk,
        grad_nvme_bytes=grad_disk,
        grad_read_bytes_per_step=grads.read,
        grad_write_bytes_per_step=grads.written,
        grad_step_read_bytes=grads.step_read,
        grad_waited_read_bytes_per_step=grads.backward_waited_read,
        grad_waited_write_bytes_per_step=grads.backward_waited_written,
        optim_read_bytes_per_step=optim_disk,
        optim_ahead_read_bytes=ahead,
        optim_write_bytes_per_step=optim_disk,
        param_write_bytes_per_step=param_write,
        param_read_bytes_per_micro_step=gathered * itemsize if param_nvme else 0,
        gather_bytes_per_micro_step=gathered * itemsize if copied else 0,
        # The CPU device (it never pins) adds gradients straight into their fp32 partitions.
        grad_offload_bytes_per_micro_step=shape.trainable_numel * itemsize if pins else 0,
        refresh_bytes_per_step=refreshed * itemsize if copied else 0,
        peak_live_numel=peak_live_numel(shape, config),
        trainable_numel=shape.trainable_numel,
        flat_numel=layout.total,
        num_sub_groups=layout.num_sub_groups,
        itemsize=itemsize,
    )


# -- terms that depend on where gradients and frozen parameters live ---------------------------


def grad_host_bytes(layout: FlatLayout, *, nvme: bool = False) -> int:
    """fp32 gradients: one flat host buffer over the optimizer's flat space, or with the
    optimizer on NVMe the `NvmeGradStore`'s sub-group buffers (`grad_buffers`)."""
    if nvme:
        count, nbytes = grad_buffers(layout.sub_group_numels)
        return count * nbytes
    return _F32 * layout.total


def grad_nvme_bytes(layout: FlatLayout) -> int:
    """The `NvmeGradStore`'s extents: one fp32 sub-group each, page-padded."""
    return sum(reserved_nbytes(n * _F32) for n in layout.sub_group_numels)


def frozen_host_bytes(shape: ModelShape, itemsize: int) -> int:
    """Frozen parameters' host partitions (host parameter tier)."""
    return sum(p.numel * itemsize for p in shape.params if not p.trainable)


def frozen_nvme_bytes(shape: ModelShape, itemsize: int) -> int:
    """Frozen parameters' extents on NVMe: one per parameter, page-padded."""
    return sum(reserved_nbytes(p.numel * itemsize) for p in shape.params if not p.trainable)


# -- the parameter tier ------------------------------------------------------------------------


def param_pool_bytes(shape: ModelShape, config: Config) -> int:
    """The NVMe parameter staging pool: `buffer_count` buffers of the largest parameter."""
    param = config.zero_optimization.offload_param
    largest = max((p.numel for p in shape.params), default=1)
    numel = param_buffer_numel(param, largest)
    return param.buffer_count * align_up(numel * model_dtype(config).itemsize)


def non_persistent_numel(shape: ModelShape, config: Config, *, trainable_only=False) -> int:
    persistent = shape.persistent(config.zero_optimization)
    return sum(
        p.numel
        for p, keep in zip(shape.params, persistent, strict=True)
        if not keep and (p.trainable or not trainable_only)
    )


def peak_live_numel(shape: ModelShape, config: Config) -> int:
    """Gathered elements at most: the budget (or the largest unit, which a gather may take
    whatever the budget), never more than the non-persistent total, plus the persistent
    ones."""
    zero = config.zero_optimization
    persistent = shape.persistent(zero)
    non_persistent = non_persistent_numel(shape, config)
    largest = max((shape.unit_numel(u, persistent=persistent) for u in shape.units), default=0)
    live = min(non_persistent, max(int(zero.max_live_parameters), largest))
    return live + shape.numel - non_persistent
