"""The model as the estimate sees it: every parameter's name, size and whether it trains, the
gather units in the order the forward runs them, and the few sizes (`ModelDims`) the
activation, FLOP and compute-probe terms read.

Built from a `LlamaConfig` (Infinity's own Llama) or a transformers config of any family
`infinity train` takes (its `AutoModelForCausalLM` class) by constructing the model on the
meta device (no memory, exact names, sizes and order, tied weights counted once) and running
one meta forward with hooks to record the order in which modules with parameters run, and
which of them a gradient flows out of (autograd on, with the run's trainable parameters). LoRA
adapters (`lora_r`) are added from shapes alone: r x (in + out) on the linear layers peft
would adapt (`block_linear_names`), the base weights frozen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infinity.config import RunFacts, ZeroConfig
from infinity.estimate.dims import ModelDims, model_dims
from infinity.models import LlamaConfig, LlamaForCausalLM
from infinity.models.lora import block_linear_names
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
    block: str | None = None
    """The transformer block the unit is in (`model.layers.3`, `transformer.h.3`), None
    outside the blocks: activation checkpointing recomputes a block as a whole."""
    grad_out: bool = True
    """Whether the module's own output needs a gradient in a training forward (recorded on
    the meta device with the run's trainable parameters; for a LoRA-adapted layer, its base
    layer's output, before the adapters add theirs): backward gathers the unit only then."""


@dataclass(frozen=True, slots=True)
class LinearShape:
    """One linear layer: y[tokens, out] = x[tokens, in] @ W^T (the compute probe's shapes)."""

    name: str
    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class ModelShape:
    """One model's parameters, gather units and matmuls, as a run of it would see them."""

    config: Any
    """The `LlamaConfig` or transformers config the model was built from."""
    dims: ModelDims
    params: tuple[ParamShape, ...]
    """In `model.named_parameters()` order: the order of the engine's records and slots."""
    units: tuple[UnitShape, ...]
    """In forward execution order."""
    linears: tuple[LinearShape, ...]
    """Every linear layer the forward runs (lm_head included)."""
    matmul_numel: int
    """Base parameters that take part in a matmul: all but the embedding lookups (a tied
    lm_head is a matmul)."""
    lora_r: int = 0
    transformers: bool = False
    """Built from transformers' class (not Infinity's Llama). Under activation
    checkpointing the engine records a transformers block's backward starting with its last
    module, then the block's recomputation, then the rest (as measured on Llama, Qwen2,
    Mistral and GPT-2 blocks); Infinity's Llama recomputes first."""

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def run_facts(self, world_size: int = 1) -> RunFacts:
        """What the config resolves for (`infinity.config.resolve_run`, the engine's
        function): this model's parameter sizes and hidden size, on `world_size` ranks."""
        numels = tuple(p.numel for p in self.params)
        return RunFacts(
            world_size=world_size,
            param_numels=numels,
            resident=True,
            hidden_size=self.dims.hidden_size,
        )

    @property
    def modules(self) -> int:
        """Modules with parameters of their own, as the engine hooks them: peft makes each
        adapted linear layer three (the base layer, lora_A and lora_B)."""
        adapted = sum(1 for p in self.params if p.name.endswith(".lora_A.weight"))
        return len(self.units) + 2 * adapted

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def probe_config(self) -> LlamaConfig:
        """The Llama the compute probe times: the model's own, or a stand-in of its sizes."""
        return self.config if isinstance(self.config, LlamaConfig) else self.dims.stand_in()

    def train_flops_per_token(self, seq_len: int) -> int:
        """Forward + backward FLOPs per token, PaLM-style (as `LlamaConfig` counts them):
        6 x matmul parameters plus 12 x layers x attention width x seq_len."""
        d = self.dims
        attn = 12 * d.num_hidden_layers * d.num_attention_heads * d.head_dim * seq_len
        return 6 * self.matmul_numel + attn

    def persistent(self, zero: ZeroConfig) -> list[bool]:
        """Which parameters stay gathered: the engine's rule (`persistent_flags`)."""
        return persistent_flags([p.numel for p in self.params], zero)


def model_shape(config: LlamaConfig | Any, *, lora_r: int = 0) -> ModelShape:
    """The parameters, units and linear layers of the model `config` describes: Infinity's
    `LlamaForCausalLM` for a `LlamaConfig`, transformers' `AutoModelForCausalLM` class for a
    transformers config (as `infinity train` builds it)."""
    if isinstance(lora_r, bool) or not isinstance(lora_r, int) or lora_r < 0:
        raise ValueError(f"lora_r must be an int >= 0 (0: full fine-tuning), got {lora_r!r}")
    dims = model_dims(config)  # an unreadable family fails before anything is built
    model = _meta_model(config)
    adapted = set(_lora_targets(model)) if lora_r else set()
    order, grad_out = _forward_order(model, adapted)
    blocks = _blocks(model)
    params: list[ParamShape] = []
    index: dict[int, int] = {}
    units: dict[str, list[int]] = {}
    linears = []
    for mname, module in model.named_modules():
        ids = []
        for pname, p in module.named_parameters(recurse=False):
            if id(p) not in index:
                index[id(p)] = len(params)
                full = f"{mname}.{pname}" if mname else pname
                params.append(ParamShape(full, p.numel(), trainable=lora_r == 0))
            ids.append(index[id(p)])
        if isinstance(module, nn.Linear):
            linears.append(LinearShape(mname, module.in_features, module.out_features))
            if mname.rsplit(".", 1)[-1] in adapted:  # peft matches the last name
                for suffix, numel in _adapters(module, lora_r):
                    ids.append(len(params))
                    params.append(ParamShape(f"{mname}.{suffix}", numel, trainable=True))
        if ids:
            units[mname] = ids
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    lookups -= {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    base = {id(p): p.numel() for p in model.parameters()}
    return ModelShape(
        config=config,
        dims=dims,
        params=tuple(params),
        units=tuple(
            UnitShape(n, tuple(units[n]), _block_of(n, blocks), grad_out[n])
            for n in order
            if n in units
        ),
        linears=tuple(linears),
        matmul_numel=sum(n for i, n in base.items() if i not in lookups),
        lora_r=lora_r,
        transformers=not isinstance(config, LlamaConfig),
    )


def _meta_model(config: LlamaConfig | Any) -> nn.Module:
    with torch.device("meta"):
        if isinstance(config, LlamaConfig):
            return LlamaForCausalLM(config, init_weights=False)
        from infinity.models import hf_auto  # imports transformers

        return hf_auto.build(config, init_weights=False)


def _lora_targets(model: nn.Module) -> list[str]:
    """The layers `infinity train --lora-r` adapts by default (`lora_targets`)."""
    names = block_linear_names(model)
    if not names:
        raise ValueError(
            "--lora-r: the model has no linear layer inside a block (an nn.ModuleList) to "
            "adapt, so `infinity train` cannot add LoRA adapters to it; estimate it without "
            "--lora-r"
        )
    return names


def _blocks(model: nn.Module) -> list[str]:
    """Names of the transformer blocks: the children of the model's ModuleLists."""
    return [
        f"{name}.{i}"
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList)
        for i in range(len(m))
    ]


def _block_of(name: str, blocks: Sequence[str]) -> str | None:
    return next((b for b in blocks if name == b or name.startswith(f"{b}.")), None)


def lora_numel(linear: LinearShape, r: int) -> int:
    """Adapter elements of one linear layer: A [r, in] and B [out, r]."""
    return r * (linear.in_features + linear.out_features)


def _adapters(module: nn.Linear, r: int) -> list[tuple[str, int]]:
    return [("lora_A.weight", r * module.in_features), ("lora_B.weight", module.out_features * r)]


def _forward_order(model: nn.Module, adapted: set[str]) -> tuple[list[str], dict[str, bool]]:
    """Names of the modules with own parameters, in the order one forward runs them, and
    whether each one's output needs a gradient (see `UnitShape.grad_out`): the forward runs
    with autograd on, every parameter trainable for full fine-tuning, only the adapters with
    LoRA (`adapted`: the layers peft adapts, whose output then needs a gradient, as their
    adapters' sum does)."""
    order: list[str] = []
    grad_out: dict[str, bool] = {}
    handles = []
    for p in model.parameters():
        p.requires_grad_(not adapted)
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:

            def pre(mod, args, name=name):
                order.append(name)

            def post(mod, args, out, name=name):
                grad_out[name] = grad_out.get(name, False) or _needs_grad(out)
                # An adapted layer's output is its base's plus the adapters': that needs one.
                if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in adapted:
                    return out + torch.zeros((), device=out.device, requires_grad=True)
                return None

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
    try:
        ids = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device="meta")
        with torch.enable_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    seen: dict[str, None] = {}
    for name in order:
        seen.setdefault(name, None)
    return list(seen), grad_out


def _needs_grad(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return out.requires_grad
    if isinstance(out, (tuple, list)):
        return any(_needs_grad(o) for o in out)
    return False
