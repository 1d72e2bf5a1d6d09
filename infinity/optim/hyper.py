"""AdamHyper: the one record of Adam/AdamW hyperparameters, checked once when it is made.

Every Adam step in the package (the engine's optimizer, `CPUAdam`, the torch reference and
the native kernel's binding) takes this record as one value; nothing else spells the
hyperparameters out or validates them. It does not hold the per-step inputs (step count,
gradient scale) nor any state.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AdamHyper:
    """Hyperparameters of one Adam/AdamW step; invalid values raise ValueError on creation."""

    lr: float
    """Learning rate, >= 0 (the engine puts each step's scheduled value in with `with_lr`)."""
    beta1: float = 0.9
    """Decay of the first moment (exp_avg), in [0, 1)."""
    beta2: float = 0.999
    """Decay of the second moment (exp_avg_sq), in [0, 1)."""
    eps: float = 1e-8
    """Added to the denominator, >= 0."""
    weight_decay: float = 0.0
    """Decay factor, >= 0; how it applies is `adamw_mode`'s choice."""
    adamw_mode: bool = True
    """True: decoupled decay (AdamW, param *= 1 - lr * weight_decay); False: L2 added to the
    gradient (Adam)."""
    bias_correction: bool = True
    """Divide the moments by 1 - beta**step."""

    def __post_init__(self) -> None:
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a real number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("adamw_mode", "bias_correction"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        if not self.lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"betas must be two values in [0, 1), got {self.betas}")
        if not self.eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")

    @classmethod
    def of(cls, *, betas: Any = (0.9, 0.999), **fields: Any) -> AdamHyper:
        """The record from torch.optim's spelling (`betas` as one pair)."""
        pair = tuple(betas) if isinstance(betas, list | tuple) else ()
        if len(pair) != 2:
            raise ValueError(f"betas must be two values in [0, 1), got {betas}")
        return cls(beta1=pair[0], beta2=pair[1], **fields)

    @classmethod
    def of_group(cls, group: Mapping[str, Any]) -> AdamHyper:
        """The record of a torch.optim param group (keys lr, betas, eps, weight_decay,
        adamw_mode, bias_correction)."""
        return cls.of(
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw_mode=group["adamw_mode"],
            bias_correction=group["bias_correction"],
        )

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)

    def with_lr(self, lr: float) -> AdamHyper:
        """The same record at learning rate `lr` (checked like the others)."""
        return dataclasses.replace(self, lr=lr)

    def without_decay(self) -> AdamHyper:
        """The same record with weight_decay 0 (for parameters excluded from decay)."""
        return dataclasses.replace(self, weight_decay=0.0)

    def constants(self) -> dict[str, float | bool]:
        """Every field but `lr` (which a schedule changes), JSON-able, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "lr"}


def hyper_from(hyper: AdamHyper | None, fields: Mapping[str, Any]) -> AdamHyper:
    """`hyper`, or the record of keyword `fields` (lr, beta1, ...) when it is None: the
    convenience spelling of the flat step functions. Giving both is a TypeError."""
    if hyper is None:
        return AdamHyper(**fields)
    if fields:
        raise TypeError(
            f"pass the hyperparameters either as hyper=AdamHyper(...) or as keywords, not both "
            f"(got hyper and {', '.join(sorted(fields))})"
        )
    if not isinstance(hyper, AdamHyper):
        raise TypeError(f"hyper must be an AdamHyper, got {type(hyper).__name__}")
    return hyper
