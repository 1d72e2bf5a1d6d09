"""The model as the estimate sees it: every parameter's name, size and whether it trains, and
the gather units in the order the forward runs them.

Built from a `LlamaConfig` by constructing the model on the meta device (no memory, exact
names, sizes and order, tied weights counted once) and running one meta forward with hooks to
record the order in which modules with parameters run. LoRA adapters (`lora_r`) are added
from shapes alone: r x (in + out) per linear layer of the blocks, the base weights frozen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from infinity.config import ZeroConfig
from infinity.models import LlamaConfig, LlamaForCausalLM
from infinity.zero.build import persistent_flags

_PROBE_TOKENS = 8  # tokens of the meta forward that records the order (any length will do)


@dataclass(frozen=True, slots=True)
class ParamShape:
    """One parameter as the engine would record it."""

    name: str
    numel: int
    trainable: bool


@dataclass(frozen=True, slots=True)
class UnitShape:
    """One module with parameters of its own (a gather unit)."""

    name: str
    params: tuple[int, ...]
    """Indices into `ModelShape.params`."""


@dataclass(frozen=True, slots=True)
class LinearShape:
    """One linear layer: y[tokens, out] = x[tokens, in] @ W^T (the compute probe's shapes)."""

    name: str
    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class ModelShape:
    """One model's parameters, gather units and matmuls, as a run of it would see them."""

    config: LlamaConfig
    params: tuple[ParamShape, ...]
    """In `model.named_parameters()` order: the order of the engine's records and slots."""
    units: tuple[UnitShape, ...]
    """In forward execution order."""
    linears: tuple[LinearShape, ...]
    """Every linear layer the forward runs (lm_head included)."""
    lora_r: int = 0

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def modules(self) -> int:
        """Modules with parameters of their own, as the engine hooks them: peft makes each
        adapted linear layer three (the base layer, lora_A and lora_B)."""
        adapted = sum(1 for lin in self.linears if ".layers." in f".{lin.name}")
        return len(self.units) + (2 * adapted if self.lora_r else 0)

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    def persistent(self, zero: ZeroConfig) -> list[bool]:
        """Which parameters stay gathered: the engine's rule (`persistent_flags`)."""
        return persistent_flags([p.numel for p in self.params], zero)

    def unit_numel(self, unit: UnitShape, *, persistent: Sequence[bool]) -> int:
        """Elements of the unit's non-persistent parameters (what a gather moves)."""
        return sum(self.params[i].numel for i in unit.params if not persistent[i])


def model_shape(config: LlamaConfig, *, lora_r: int = 0) -> ModelShape:
    """The parameters, units and linear layers of a `LlamaForCausalLM` of `config`."""
    if isinstance(lora_r, bool) or not isinstance(lora_r, int) or lora_r < 0:
        raise ValueError(f"lora_r must be an int >= 0 (0: full fine-tuning), got {lora_r!r}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, init_weights=False)
    order = _forward_order(model)
    params: list[ParamShape] = []
    index: dict[int, int] = {}
    units_by_module: dict[str, list[int]] = {}
    linears = []
    for mname, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        ids = []
        for pname, p in own:
            if id(p) not in index:
                index[id(p)] = len(params)
                full = f"{mname}.{pname}" if mname else pname
                params.append(ParamShape(full, p.numel(), trainable=lora_r == 0))
            ids.append(index[id(p)])
        if isinstance(module, nn.Linear):
            linears.append(LinearShape(mname, module.in_features, module.out_features))
            if lora_r and ".layers." in f".{mname}":
                for suffix, numel in _adapters(module, lora_r):
                    ids.append(len(params))
                    params.append(ParamShape(f"{mname}.{suffix}", numel, trainable=True))
        if ids:
            units_by_module[mname] = ids
    units = tuple(UnitShape(n, tuple(units_by_module[n])) for n in order if n in units_by_module)
    return ModelShape(config, tuple(params), units, tuple(linears), lora_r)


def lora_numel(linear: LinearShape, r: int) -> int:
    """Adapter elements of one linear layer: A [r, in] and B [out, r]."""
    return r * (linear.in_features + linear.out_features)


def _adapters(module: nn.Linear, r: int) -> list[tuple[str, int]]:
    return [("lora_A.weight", r * module.in_features), ("lora_B.weight", module.out_features * r)]


def _forward_order(model: nn.Module) -> list[str]:
    """Names of the modules with own parameters, in the order one forward runs them."""
    order: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:

            def hook(mod, args, name=name):
                order.append(name)

            handles.append(module.register_forward_pre_hook(hook))
    try:
        ids = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device="meta")
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    seen: dict[str, None] = {}
    for name in order:
        seen.setdefault(name, None)
    return list(seen)
