"""Building the storage tiers from the config: the one place that turns `offload_optimizer`,
`offload_param` and `aio` sections into a state tier and a parameter tier.

Owns the choice between the host and NVMe tiers and the sizing of their buffers; it does not
own the tiers themselves. Everything that can fail on a bad path or a small disk fails here,
before training starts (see [Note: swap directory checks] in store.py).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping, Sequence

import torch

from infinity.accelerator import Accelerator
from infinity.config.sections import AioConfig, OffloadOptimizerConfig, OffloadParamConfig
from infinity.io.aio import AioHandle
from infinity.swap.grad_device import DeviceGradTier
from infinity.swap.grad_half import HalfGradTier
from infinity.swap.grad_plan import grad_footprint
from infinity.swap.grad_tier import GradTier, HostGradTier, NvmeGradTier
from infinity.swap.nvme_state import NvmeStateTier, nvme_state_footprint
from infinity.swap.param_tier import NvmeParamTier
from infinity.swap.pool import PinnedBufferPool
from infinity.swap.split_state import (
    SplitGradTier,
    SplitStateTier,
    grad_split,
    state_in_ram,
)
from infinity.swap.state_tier import HostStateTier, StateFormat, StateTier
from infinity.swap.store import SwapStore, default_run_id
from infinity.utils.host_memory import physical_ram

logger = logging.getLogger(__name__)

_made = itertools.count()


def _next_run_id() -> str:
    """The launcher's run id (or the pid), with a suffix from the second engine of a process
    on: engines of one process never share swap files."""
    n = next(_made)
    return default_run_id() + (f".{n}" if n else "")


class SwapStores:
    """This rank's swap stores, one per `nvme_path` (parameters and optimizer state share one
    directory and one lock when their paths agree). Close it after the tiers that use it."""

    def __init__(self, *, rank: int = 0, run_id: str | None = None) -> None:
        self.rank, self.run_id = rank, run_id or _next_run_id()
        self._stores: dict[str, SwapStore] = {}

    def get(self, nvme_path: str) -> SwapStore:
        key = os.path.realpath(nvme_path)
        if key not in self._stores:
            self._stores[key] = SwapStore(nvme_path, rank=self.rank, run_id=self.run_id)
        return self._stores[key]

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores.clear()

    def __enter__(self) -> SwapStores:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_state_tier(
    numels: Sequence[int],
    offload: OffloadOptimizerConfig,
    aio: AioConfig | AioHandle,
    *,
    stores: SwapStores,
    fmt: StateFormat = StateFormat.ADAMW,
) -> StateTier:
    """The optimizer-state tier for `offload.device`: host memory for "cpu"/"none", else an
    `NvmeStateTier` in the swap store of `offload.nvme_path`, or a `SplitStateTier` when
    `offload.max_in_cpu` keeps the first sub-groups in host memory; every one holds state
    of format `fmt` (32-bit or 8-bit moments)."""
    in_ram = state_in_ram(numels, offload)
    if in_ram == len(numels):
        return HostStateTier(numels, fmt)
    if not offload.nvme_path:
        raise ValueError(
            "offload_optimizer.nvme_path is required when offload_optimizer.device is 'nvme'"
        )
    on_nvme = list(numels[in_ram:])
    state = nvme_state_footprint(on_nvme, offload.buffer_count, fmt)
    _, spill_from = grad_split(numels, offload)
    spilled = grad_footprint(numels[spill_from:], nvme=True).host if spill_from < len(numels) else 0
    check_host_buffers(state.host + spilled)  # the pipelines' buffers, not planned RAM
    if not (offload.pipeline_read and offload.pipeline_write):
        logger.info(
            "offload_optimizer.pipeline_read=%s, pipeline_write=%s: the optimizer's NVMe "
            "transfers overlap its step only where true (both true is faster)",
            offload.pipeline_read, offload.pipeline_write,
        )  # fmt: skip

    def nvme(numels: list[int]) -> NvmeStateTier:
        return NvmeStateTier(
            numels,
            store=stores.get(offload.nvme_path),
            aio=aio,
            buffer_count=offload.buffer_count,
            pin_memory=offload.pin_memory,
            pipeline_read=offload.pipeline_read,
            pipeline_write=offload.pipeline_write,
            fmt=fmt,
        )

    return SplitStateTier(numels, in_ram, nvme) if in_ram else nvme(on_nvme)


def make_grad_tier(
    numels: Sequence[int],
    offload: OffloadOptimizerConfig,
    aio: AioConfig | AioHandle,
    *,
    stores: SwapStores,
    accelerator: Accelerator | None = None,
    half_dtype: torch.dtype | None = None,
) -> GradTier:
    """The gradient tier follows the optimizer state's (`gradients_spill`): with state on
    NVMe the host keeps `GRAD_BUFFERS` sub-groups of gradients and the rest go to the same
    swap store (see [Note: spilled gradients] in grad_tier.py), except those of the
    sub-groups whose state is kept in RAM; with all of the state in RAM, or
    `gradients_in_cpu`, one flat host buffer. The first sub-groups `gradients_on_device`
    holds stay on `accelerator`'s device (`DeviceGradTier`). Which is where: `grad_split`.
    `half_dtype` (fp16/bf16, one micro batch a step): all in host memory, the gradients are
    kept as they come (`HalfGradTier`)."""
    on_device, spill_from = grad_split(numels, offload)
    if on_device == 0 and spill_from == len(numels):  # every sum in host memory
        return HalfGradTier(numels, half_dtype) if half_dtype else HostGradTier(numels)
    parts: list[tuple[int, GradTier]] = []
    if on_device:
        if accelerator is None:
            raise ValueError(
                "offload_optimizer.gradients_on_device is set but no accelerator was given "
                "to keep them on"
            )
        if accelerator.device.type == "cpu":
            logger.warning(
                "offload_optimizer.gradients_on_device %d: on the CPU device the device's "
                "memory is host RAM, so the first %d sub-groups' gradient sums stay in RAM "
                "(as gradients_in_cpu keeps them); the key saves host copies only on a GPU",
                offload.gradients_on_device, on_device,
            )  # fmt: skip
        parts.append((on_device, DeviceGradTier(numels[:on_device], accelerator)))
    if spill_from > on_device:
        parts.append((spill_from - on_device, HostGradTier(numels[on_device:spill_from])))
    if spill_from < len(numels):
        nvme = NvmeGradTier(numels[spill_from:], store=stores.get(offload.nvme_path), aio=aio)
        parts.append((len(numels) - spill_from, nvme))
    if len(parts) < 2:
        return parts[0][1] if parts else HostGradTier(numels)
    return SplitGradTier(numels, parts)


def check_host_buffers(nbytes: int, ram_bytes: int | None = None) -> None:
    """Refuse NVMe optimizer buffers that would take more than half of the machine's RAM
    (the usual cause: the default sub_group_size of 1e9 elements, 12 GB per buffer)."""
    ram = ram_bytes if ram_bytes is not None else physical_ram()
    if ram and nbytes > ram // 2:
        raise ValueError(
            f"the NVMe optimizer pipeline needs {nbytes / 2**30:.1f} GiB of host buffers "
            f"(offload_optimizer.buffer_count x 12 bytes (6 with 8-bit Adam) + 3 gradient "
            f"buffers x 4 bytes, per "
            f"element of the largest sub-group) but the machine has {ram / 2**30:.1f} GiB of "
            f"RAM; lower zero_optimization.sub_group_size (e.g. to 2e7 elements) or "
            f"offload_optimizer.buffer_count (at least 3)"
        )


def make_param_tier(
    params: Mapping[str, tuple[int, torch.dtype]],
    offload: OffloadParamConfig,
    aio: AioConfig | AioHandle,
    *,
    stores: SwapStores,
    numels: Sequence[int] = (),
    element_size: int = 0,
    prefetch_numel: int = 0,
) -> NvmeParamTier:
    """The NVMe parameter tier (`offload.device == "nvme"`): every home in `params`
    (stable name -> (numel, dtype)) laid out under `offload.nvme_path` (more can be laid out
    later with `reserve_flat`), with a staging pool sized from `offload` and the homes
    of the model (`numels`, of `element_size` bytes, with those in `params`)."""
    if offload.device != "nvme" or not offload.nvme_path:
        raise ValueError(
            f"make_param_tier needs offload_param.device 'nvme' and an nvme_path, got "
            f"device={offload.device!r}, nvme_path={offload.nvme_path!r}"
        )
    numels = [*numels, *(n for n, _ in params.values())] or [1]
    element_size = (
        max(
            [torch.empty((), dtype=dt).element_size() for _, dt in params.values()] + [element_size]
        )
        or 2
    )
    pool = PinnedBufferPool.for_params(
        offload, element_size=element_size, numels=numels, prefetch_numel=prefetch_numel
    )
    ps = NvmeParamTier(store=stores.get(offload.nvme_path), aio=aio, pool=pool)
    if params:
        ps.reserve(params)
    return ps
