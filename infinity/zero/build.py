"""Building partitioned models: `init(config)` and `partition_model`.

Under `init`, every parameter a module registers is moved at once into a fresh flat
partition in its home tier (host memory, in the model dtype) and the parameter becomes a
view of it (one whose own memory already qualifies is kept). Nothing is pinned while the
model is built: which parameters will train is not known yet, and a trainable partition is
only read once, by the optimizer, into its own (pinned) weight buffer; a frozen home is
pinned by `partition_model`, a copy made one parameter at a time. A module's
own initialization (`reset_parameters`, `nn.Parameter(torch.ones(...))`, a model's
`init_weights`) therefore runs on the partition itself, and the model never exists twice in
RAM: the peak is the partitions plus one parameter. `partition_model` then builds one
`OffloadParam` per parameter with the home a `HomePlan` gives it (a frozen parameter's home
is its partition, adopted from memory that qualifies or copied, or its NVMe extent written
from it; a trainable parameter's partition is handed to the optimizer, which writes it into
its home) and releases them all.

Parameters are created with real values rather than on the meta device because arbitrary
init code must see them (a module's `reset_parameters`, a Hugging Face model's `post_init`
that re-initializes every module after the whole model exists). With
`offload_param.device = "nvme"` the partitions are not in anonymous host memory at all: see
[Note: building on NVMe].

[Note: building on NVMe] Each partition is a shared mapping of its own file in
`offload_param.nvme_path`, unlinked as soon as it is mapped (the space returns to the disk
when the mapping goes; a crash leaves nothing behind). Init code writes into the page cache,
and every `RELEASE_PERIOD_S` a timer drops the pages of all partitions from the process
(`MADV_DONTNEED`: the kernel keeps their contents in the page cache, writes them back to the
file and can reclaim them; a later touch faults them back in), so neither construction nor a
whole-model init pass after it (Hugging Face's `post_init`) maps the model in. The anonymous
peak of a build is one parameter, whatever the model size, and the weights are bitwise those
of a build in RAM: the same code runs on the same values in the same order. The optimizer
then copies every trainable partition to its NVMe home one sub-group at a time (a frozen one
is written as its record is built), and the mappings go with the partitions.

[Note: a build that spares RAM] With the parameters in RAM and a swap directory given
(`offload_param.nvme_path`, as `infinity train --nvme` sets it), the build goes through
files too. Built in RAM, every trainable partition would sit beside the optimizer's own
weight buffer until the optimizer had copied it (pinned, on a GPU, and thrown away after):
the model's 16-bit size on top of the run's steady RAM, at its start. Through files, the
optimizer reads each sub-group's partitions and drops their pages as it goes, and a frozen
parameter's home is a copy in anonymous (pinned) memory made one parameter at a time
(`partition_model` never adopts a file mapping as a host home). A disk too full for the
build only costs the RAM: the rest of the model is built in RAM, with a warning.

Supported: any module whose parameters are registered through `nn.Module.__setattr__` or
`register_parameter` (all of torch.nn, `infinity.models`, Hugging Face models), tied
parameters (one record per `nn.Parameter` object), frozen parameters. A model already on the
meta device is refused (its values do not exist).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from infinity.accelerator import Accelerator, get_accelerator
from infinity.comm import Comm
from infinity.config import Config, ResolvedConfig, ResolvedZero, RunFacts, resolve_run
from infinity.io.aio import zeroed
from infinity.zero.build_files import BuildFiles, BuildPages
from infinity.zero.home import HomeTier, HostHome, NvmeHome, ParamHome
from infinity.zero.param import OffloadParam
from infinity.zero.shard import Shard, shard_of
from infinity.zero.unit import ModuleUnit
from infinity.zero.weights import HostWeights, NvmeWeights

if TYPE_CHECKING:
    from infinity.swap.param_tier import NvmeParamTier

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def model_dtype(config: Config) -> torch.dtype:
    return _DTYPES[config.precision]


def communication_dtype(config: Config) -> torch.dtype:
    """The dtype gradients are reduce-scattered in (`Config.communication_dtype`)."""
    return _DTYPES[config.communication_dtype]


def is_persistent(numel: int, threshold: int) -> bool:
    """A parameter below `param_persistence_threshold` elements stays gathered between uses
    (within the live budget: see `persistent_flags`)."""
    return numel < threshold


def persistent_flags(numels: Sequence[int], zero: ResolvedZero) -> list[bool]:
    """Which parameters (in model order) stay gathered between uses: those below
    `param_persistence_threshold`, as long as they fit the live budget. When every
    parameter fits `max_live_parameters` at once, all below the threshold do (a threshold
    above the largest parameter then keeps the whole model gathered across iterations: no
    gather copies, one refresh per step). Otherwise persistent ones stop where they would
    leave less than the largest parameter's room under the budget, so persistence never
    breaks the bound (see [Note: the live budget] in live_plan.py)."""
    threshold, budget = zero.param_persistence_threshold, zero.max_live_parameters
    room = budget if sum(numels) <= budget else budget - max(numels, default=0)
    flags = []
    for numel in numels:
        keep = is_persistent(numel, threshold) and numel <= room
        room -= numel if keep else 0
        flags.append(keep)
    return flags


def home_tier(config: Config) -> HomeTier:
    device = config.zero_optimization.offload_param.device
    return HomeTier.NVME if device == "nvme" else HomeTier.HOST


def builds_in_files(config: Config, *, here: bool = True) -> bool:
    """Whether `init` builds the partitions in files (see [Note: building on NVMe]): with
    the parameters on NVMe, and with them in RAM whenever `offload_param.nvme_path` is a
    directory (see [Note: a build that spares RAM]). `here` False: for a run on another
    machine, whose path is taken to exist (the estimate's)."""
    offload = config.zero_optimization.offload_param
    if home_tier(config) is HomeTier.NVME:
        return True
    return bool(offload.nvme_path) and (not here or os.path.isdir(str(offload.nvme_path)))


def _new_partition(
    src: torch.Tensor,
    dtype: torch.dtype,
    accel: Accelerator,
    pin: bool,
    shard: Shard | None = None,
    *,
    values: bool = True,
) -> torch.Tensor:
    """A new flat partition holding `src` (or its `shard`'s span, zero-padded; `values` False:
    zeros of its size, which cost nothing until written: see `zeroed`)."""
    numel = src.numel() if shard is None else shard.numel
    if not values:
        return zeroed(numel, dtype, written_first=True)  # a loader writes every byte
    if pin and accel.pin_supported():
        part = accel.empty_pinned((numel,), dtype)
    else:
        part = torch.empty(numel, dtype=dtype)
    flat = src.detach().reshape(-1)
    with torch.no_grad():
        if shard is None:
            part.copy_(flat)
        else:
            n = shard.stop - shard.start
            part[:n].copy_(flat[shard.start : shard.stop])
            part[n:].zero_()
    return part


def _adoptable(param: torch.Tensor, dtype: torch.dtype, accel: Accelerator, pin: bool) -> bool:
    """Can `param`'s own memory serve as its partition? (host, model dtype, contiguous, sole
    user of its storage, pinned if pinning is wanted and possible)"""
    return (
        param.device.type == "cpu"
        and param.dtype == dtype
        and param.is_contiguous()
        and param.storage_offset() == 0
        and param.untyped_storage().nbytes() == param.numel() * param.element_size()
        and (param.is_pinned() or not (pin and accel.pin_supported()))
    )


@contextlib.contextmanager
def init(
    config: Config | ResolvedConfig | dict | str, *, comm: Comm | None = None, values: bool = True
) -> Iterator[None]:
    """Create every parameter registered inside this block directly as a host partition.
    `comm` (default: $LOCAL_RANK) picks this rank's entry of a per-rank `nvme_path` list.
    `values` False: the parameters' values are not copied (a model built without init,
    whose weights a loader or `random_init` writes next): the partitions start as zeros and
    the memory the construction allocated is never touched."""
    local_rank = comm.local_rank if comm is not None else int(os.environ.get("LOCAL_RANK", 0))
    if isinstance(config, ResolvedConfig):  # a run's own: only its precision and pinning used
        config = config.for_local_rank(local_rank)
    else:
        config = resolve_run(Config.load(config), RunFacts(local_rank=local_rank))
    dtype = model_dtype(config)
    offload = config.zero_optimization.offload_param
    files = BuildFiles(offload.nvme_path) if builds_in_files(config) else None
    must = home_tier(config) is HomeTier.NVME  # else the files only spare RAM
    accel = get_accelerator()

    def on_register(module: nn.Module, name: str, param: nn.Parameter | None):
        nonlocal files
        if param is None or param.is_meta or not param.is_floating_point():
            return None
        if files is not None and files.owns(param):
            return None  # already a partition (a tied parameter registered again)
        if files is not None:
            try:
                part = files.new_partition(param, dtype, values=values)
                return nn.Parameter(part.view(param.shape), requires_grad=param.requires_grad)
            except OSError as e:
                if must:
                    raise
                logger.warning("building the rest of the model in RAM: %s", e)
                files.close()
                files = None
        if _adoptable(param, dtype, accel, pin=False):
            return None  # already a partition (a tied parameter registered again)
        part = _new_partition(param, dtype, accel, pin=False, values=values)
        return nn.Parameter(part.view(param.shape), requires_grad=param.requires_grad)

    handle = nn.modules.module.register_module_parameter_registration_hook(on_register)
    try:
        yield
    finally:
        handle.remove()
        if files is not None:
            files.close()


@dataclass(frozen=True, slots=True)
class HomePlan:
    """Which home each parameter gets: decided once, before any record or the optimizer
    exists, so every record is built with its final home."""

    weights: HostWeights | NvmeWeights
    """The optimizer's weight output: trainable slot i's home is `weights.home(i)`."""
    slots: dict[str, int]
    """Trainable parameter name -> its slot in the optimizer, in model order."""
    param_tier: NvmeParamTier | None = None
    """The NVMe parameter tier, when `offload_param.device` is "nvme"."""
    frozen_on_nvme: frozenset[str] = frozenset()
    """Frozen parameters whose home is their own extent in `param_tier` (the others keep
    their partition in host memory)."""
    comm: Comm | None = None
    """With several ranks, every home holds this rank's shard (see `infinity.zero.shard`)."""
    align: int = 1
    """The shards' alignment (`infinity.zero.shard.shard_align`)."""

    def shard(self, numel: int) -> Shard:
        """This rank's shard of a parameter of `numel` elements."""
        c = self.comm
        return (
            shard_of(numel, 1, 0)
            if c is None
            else shard_of(numel, c.world_size, c.rank, self.align)
        )

    def home(self, name: str, partition: torch.Tensor) -> ParamHome:
        """The home of parameter `name` whose build partition is `partition`. A trainable
        home starts empty: the optimizer writes it from the partition (see `partition_model`);
        a frozen one on NVMe is written here (and the partition can go)."""
        slot = self.slots.get(name)
        if slot is not None:
            return self.weights.home(slot)
        if name in self.frozen_on_nvme:
            assert self.param_tier is not None
            home = NvmeHome(self.param_tier, name)
            home.write(partition)
            return home
        return HostHome(partition, name=name)


def _partition(
    param: torch.Tensor,
    trainable: bool,
    plan: HomePlan,
    dtype: torch.dtype,
    accel: Accelerator,
    pin: bool,
    built: BuildPages,
) -> torch.Tensor:
    """A parameter's partition for its home (or, trainable, for the optimizer to read): its
    own memory where that qualifies, else a copy (this rank's shard with several ranks). A
    trainable partition is only read, into the optimizer's own buffer: it needs no pinning
    and may be a build file's mapping; a host home never is one (see [Note: a build that
    spares RAM])."""
    shard = plan.shard(param.numel())
    pin = pin and not trainable
    if shard.numel != param.numel():
        return _new_partition(param, dtype, accel, pin, shard)
    if _adoptable(param, dtype, accel, pin) and (trainable or not built.holds(param)):
        return param.detach().view(-1)
    return _new_partition(param, dtype, accel, pin)


def partition_model(
    model: nn.Module, config: Config, accel: Accelerator, plan: HomePlan
) -> tuple[list[OffloadParam], dict[nn.Module, ModuleUnit], list[torch.Tensor]]:
    """One record per parameter with its home from `plan`, one unit per module, and the
    trainable parameters' partitions in slot order (the optimizer's initial weights: it
    writes them into their homes; drop them after). With several ranks (`plan.comm`) the
    homes and the returned partitions are this rank's shards: every rank must have built
    the same weights (the same seed), and the rest of each parameter is dropped here.

    Every parameter is released on return; floating-point buffers are cast to the model dtype
    and moved to the device (they stay resident).
    """
    dtype = model_dtype(config)
    zero = config.zero_optimization
    named = list(model.named_parameters())
    persistent = persistent_flags([p.numel() for _, p in named], zero)
    # An NVMe home is written from host memory, never copied to the device from it.
    pin = zero.offload_param.pin_memory and home_tier(config) is HomeTier.HOST
    built = BuildPages([p for _, p in named])  # [Note: a build that spares RAM]
    records: list[OffloadParam] = []
    sources: list[torch.Tensor] = [torch.empty(0)] * len(plan.slots)
    by_param: dict[nn.Parameter, OffloadParam] = {}
    for (name, param), keep in zip(named, persistent, strict=True):
        if param.is_meta:
            raise ValueError(
                f"parameter {name!r} is on the meta device: its values do not exist; build "
                f"the model under `with infinity.init(config):` instead"
            )
        part = _partition(param, name in plan.slots, plan, dtype, accel, pin, built)
        rec = OffloadParam(
            name,
            param,
            plan.home(name, part),
            device=accel.device,
            persistent=keep,
            comm=plan.comm,
            align=plan.align,
        )
        rec.slot = plan.slots.get(name)
        if rec.slot is not None:
            sources[rec.slot] = part
        rec.offload()  # the parameter's own memory (if not the partition) is freed here
        records.append(rec)
        by_param[param] = rec
    for module in model.modules():
        for bname, buf in module.named_buffers(recurse=False):
            new = buf.to(accel.device, dtype=dtype if buf.is_floating_point() else None)
            if new is not buf:
                setattr(module, bname, new)
    units = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        if module not in units:
            own = [by_param[p] for p in module.parameters(recurse=False)]
            units[module] = ModuleUnit(mname or "<root>", own)
    return records, units, sources
