"""Building partitioned models: `init(config)` and `partition_model`.

Under `init`, every parameter a module registers is moved at once into a fresh flat
partition in its home tier (host memory, pinned with CUDA, in the model dtype) and the
parameter becomes a view of it, so a module's own initialization (`reset_parameters`,
`nn.Parameter(torch.ones(...))`, a model's `init_weights`) runs on the partition itself and
the model never exists twice in RAM: the peak is the partitions plus one parameter.
`partition_model` then builds one `OffloadParam` per parameter (adopting those partitions,
copying any other parameter) and releases them all.

Supported: any module whose parameters are registered through `nn.Module.__setattr__` or
`register_parameter` (all of torch.nn, `infinity.models`, Hugging Face models), tied
parameters (one record per `nn.Parameter` object), frozen parameters. A model that already
sits on the meta device is not supported (its values are gone); build it under `init`.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from infinity.accelerator import Accelerator, get_accelerator
from infinity.config import Config
from infinity.zero.param import HomeTier, OffloadParam
from infinity.zero.unit import ModuleUnit

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Partitions created under init(), found again by partition_model (weak: dropped with the
# parameter).
_BORN: weakref.WeakKeyDictionary[nn.Parameter, torch.Tensor] = weakref.WeakKeyDictionary()


def model_dtype(config: Config) -> torch.dtype:
    return _DTYPES[config.precision]


def home_tier(config: Config) -> HomeTier:
    device = config.zero_optimization.offload_param.device
    return HomeTier.NVME if device == "nvme" else HomeTier.HOST


def _new_partition(
    src: torch.Tensor, dtype: torch.dtype, accel: Accelerator, pin: bool
) -> torch.Tensor:
    if pin and accel.pin_supported():
        part = accel.empty_pinned((src.numel(),), dtype)
    else:
        part = torch.empty(src.numel(), dtype=dtype)
    with torch.no_grad():
        part.copy_(src.detach().reshape(-1))
    return part


@contextlib.contextmanager
def init(config: Config | dict | str) -> Iterator[None]:
    """Create every parameter registered inside this block directly as a host partition."""
    config = Config.load(config).resolve()
    dtype = model_dtype(config)
    pin = config.zero_optimization.offload_param.pin_memory
    accel = get_accelerator()
    if home_tier(config) is HomeTier.NVME:
        raise NotImplementedError(
            "infinity.init: offload_param.device 'nvme' is not available yet; use 'cpu'"
        )

    def on_register(module: nn.Module, name: str, param: nn.Parameter | None):
        if param is None or param in _BORN or param.is_meta:
            return None
        if not param.is_floating_point():
            return None
        part = _new_partition(param, dtype, accel, pin)
        new = nn.Parameter(part.view(param.shape), requires_grad=param.requires_grad)
        _BORN[new] = part
        return new

    handle = nn.modules.module.register_module_parameter_registration_hook(on_register)
    try:
        yield
    finally:
        handle.remove()


def partition_model(
    model: nn.Module, config: Config, accel: Accelerator
) -> tuple[list[OffloadParam], dict[nn.Module, ModuleUnit]]:
    """One record per parameter (partitions adopted or copied) and one unit per module.

    Every parameter is released on return; floating-point buffers are cast to the model dtype
    and moved to the device (they stay resident).
    """
    dtype = model_dtype(config)
    zero = config.zero_optimization
    threshold = int(zero.param_persistence_threshold)
    pin = zero.offload_param.pin_memory
    records: list[OffloadParam] = []
    by_param: dict[nn.Parameter, OffloadParam] = {}
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(
                f"parameter {name!r} is on the meta device: its values do not exist; build "
                f"the model under `with infinity.init(config):` instead"
            )
        part = _BORN.get(param)
        if part is None or part.dtype != dtype:
            part = _new_partition(param, dtype, accel, pin)
        rec = OffloadParam(
            name,
            param,
            part,
            device=accel.device,
            home=home_tier(config),
            persistent=param.numel() < threshold,
        )
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
    return records, units
