"""LoRA adapters through peft: which layers get them, their names in a checkpoint, and the
two ways out of a run (the adapter alone, as `peft.PeftModel.from_pretrained` loads it, or
merged into the base weights one tensor at a time).

The adapters are peft's own modules (`peft.get_peft_model`), never written here. Applied
inside `infinity.init`, their weights are created as partitions like any other parameter;
peft freezes the base, so the engine trains only the adapters and checkpoints leave the
base out. peft is an optional dependency (the `lora` extra), imported when first needed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."
"""What `peft.get_peft_model` puts in front of every parameter name of the base model."""
ADAPTER = "default"
"""The adapter's name inside the peft model (peft's default)."""


@dataclass(kw_only=True, slots=True)
class LoraSpec:
    """The adapters of a run: rank, scale, dropout and the layers that get them."""

    r: int
    """Rank of each adapter pair (A: r x in, B: out x r)."""
    alpha: float | None = None
    """Scale numerator: the update is B @ A * alpha / r. None: alpha = r (scale 1)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps training deterministic)."""
    targets: tuple[str, ...] | None = None
    """Names of the linear layers to adapt (e.g. q_proj, v_proj); None: every linear layer
    of the transformer blocks."""

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoRA rank r must be a positive whole number, got {self.r!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.targets is not None:
            self.targets = tuple(self.targets)
            if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
                raise ValueError(
                    f"LoRA targets must be layer names such as q_proj,v_proj, got {self.targets}"
                )

    @property
    def scaling(self) -> float:
        return (self.r if self.alpha is None else self.alpha) / self.r

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"targets": list(self.targets or []) or None}

    @classmethod
    def from_dict(cls, d: Mapping) -> LoraSpec:
        targets = d.get("targets")
        return cls(
            r=int(d["r"]),
            alpha=d.get("alpha"),
            dropout=float(d.get("dropout", 0.0)),
            targets=tuple(targets) if targets else None,
        )


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError(
            "LoRA needs the peft package: pip install 'infinity-trainer[lora]' (or pip install "
            "peft)"
        ) from None
    return peft


def block_linear_names(model: nn.Module) -> list[str]:
    """Names of the linear layers inside the transformer blocks (modules in a ModuleList):
    q_proj, k_proj, ... for a Llama; the output head is not in a block."""
    names: set[str] = set()
    for block_list in (m for m in model.modules() if isinstance(m, nn.ModuleList)):
        for qualified, module in block_list.named_modules():
            if isinstance(module, nn.Linear):
                names.add(qualified.rsplit(".", 1)[-1])
    return sorted(names)


def lora_targets(model: nn.Module, spec: LoraSpec) -> list[str]:
    """The layer names `spec` adapts in `model`; unknown names, layers that cannot take an
    adapter and a rank larger than a layer are a ValueError."""
    available = block_linear_names(model)
    conv1d = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_conv1d(m)})
    if spec.targets is None:
        if not available:
            raise ValueError(
                "the model has no linear layer inside a block (an nn.ModuleList) to adapt"
                + _conv1d_note(conv1d, conv1d)
                + "; name the layers with targets (--lora-targets)"
            )
        targets = available
    else:
        linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_linear(m)}
        unknown = sorted(set(spec.targets) - linear)
        if unknown:
            raise ValueError(
                f"LoRA targets {unknown} are not linear layers of this model"
                + _conv1d_note(conv1d, unknown)
                + f"; choose from {sorted(linear)} (default: {','.join(available)})"
            )
        targets = list(spec.targets)
    _check_rank(model, spec.r, targets)
    return targets


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's attention and MLP layers): a linear layer with its
    weight stored transposed, which the adapters here do not take."""
    return type(module).__name__ == "Conv1D"


def _conv1d_note(conv1d: list[str], named: list[str]) -> str:
    hit = sorted(set(conv1d) & set(named))
    if not hit:
        return ""
    return (
        f" ({', '.join(hit)} are transformers' Conv1D layers, as in GPT-2, which cannot take "
        "LoRA adapters here: only nn.Linear layers can; choose a model built of nn.Linear "
        "layers, e.g. Llama, Qwen2 or Mistral, or train it without --lora-r)"
    )


def _check_rank(model: nn.Module, r: int, targets: list[str]) -> None:
    """A rank above min(in, out) of a layer adds parameters and nothing else."""
    wanted = set(targets)
    for name, m in model.named_modules():
        if _is_linear(m) and name.rsplit(".", 1)[-1] in wanted:
            limit = min(m.in_features, m.out_features)
            if r > limit:
                raise ValueError(
                    f"LoRA rank r (--lora-r) {r} is larger than layer {name} "
                    f"({m.in_features} in, {m.out_features} out): a rank above min(in, out) = "
                    f"{limit} adds parameters but no capacity; use --lora-r {limit} or less"
                )


def peft_config(
    spec: LoraSpec, targets: list[str], base: str | None = None, task_type: str | None = None
):
    """The `peft.LoraConfig` of `spec` (adapter weights initialized as peft does: B = 0).
    `task_type` "CAUSAL_LM" in a saved adapter lets `AutoPeftModelForCausalLM` load it."""
    return _peft().LoraConfig(
        r=spec.r,
        lora_alpha=spec.r if spec.alpha is None else spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        bias="none",
        base_model_name_or_path=base,
        task_type=task_type,
    )


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """`model` wrapped by `peft.get_peft_model` with the adapters of `spec`; only the adapter
    weights require gradients. Call it inside `infinity.init` to create them as partitions."""
    config = peft_config(spec, lora_targets(model, spec))
    # autocast_adapter_dtype=False: the adapters take the model dtype, like every partition.
    return _peft().get_peft_model(model, config, autocast_adapter_dtype=False)


def inject_lora(module: nn.Module, spec: LoraSpec, targets: list[str]) -> nn.Module:
    """`module` (any module, a single block too) with the adapters of `spec` put on the linear
    layers named `targets` in place, in the dtype of the module, without peft's model wrapper:
    the layers `apply_lora` builds, for timing them alone."""
    dtype = next(module.parameters()).dtype
    module = _peft().inject_adapter_in_model(peft_config(spec, targets), module)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if is_adapter(name):
                p.data = p.data.to(dtype)
    return module


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A peft parameter name as the base model names it (prefix and base_layer removed)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_key(name: str) -> str:
    """The key peft's `save_pretrained` gives an adapter weight (the adapter name dropped)."""
    return name.replace(f".{ADAPTER}.", ".")


def write_adapter(
    out: str | os.PathLike,
    spec: LoraSpec,
    targets: list[str],
    adapters: Iterable[tuple[str, torch.Tensor]],
    *,
    base: str | None = None,
    task_type: str | None = None,
) -> Path:
    """A directory `peft.PeftModel.from_pretrained(base_model, out)` loads: adapter_config.json
    (peft's own writer) and adapter_model.safetensors. Written under a temporary name and
    renamed into place, so `out` is complete or absent. `task_type` "CAUSAL_LM" (for a base
    that is a transformers model) lets `AutoPeftModelForCausalLM` load it."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} exists; give a new directory (nothing is overwritten)")
    tmp = out.with_name(f".tmp.{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors = {adapter_key(n): t.contiguous() for n, t in adapters if is_adapter(n)}
        if not tensors:
            raise ValueError("no LoRA adapter weights to write (no lora_A / lora_B tensors)")
        peft_config(spec, targets, base, task_type).save_pretrained(tmp)
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def merged_weights(
    base: Iterable[tuple[str, torch.Tensor]],
    adapters: Mapping[str, torch.Tensor],
    spec: LoraSpec,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base weights with each adapted layer's update added (W + B @ A * alpha / r, in
    fp32), one tensor at a time. `adapters` maps peft names (from the checkpoint) to their
    weights; `base` yields (base-model name, tensor)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in adapters.items():
        if is_adapter(name):
            module = base_name(name).split(".lora_")[0]
            pairs.setdefault(module, {})["A" if ".lora_A." in name else "B"] = t
    used = set()
    for name, w in base:
        module = name.removesuffix(".weight")
        pair = pairs.get(module) if name.endswith(".weight") else None
        if pair is not None:
            delta = pair["B"].float() @ pair["A"].float() * spec.scaling
            w = (w.float() + delta).to(w.dtype)
            used.add(module)
        yield name, w
    missing = sorted(set(pairs) - used)
    if missing:
        raise ValueError(f"adapters {missing[:3]} have no base weight to merge into")
