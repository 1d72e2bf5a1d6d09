"""Loss scaling for fp16: dynamic (DeepSpeed semantics), static, and a no-op for fp32/bf16.

The engine multiplies the loss by `scaler.scale`, checks the gradients with `has_overflow`,
skips the step on overflow, and calls `scaler.update(overflow)` once per optimizer step either
way. With `NoScaler` (fp32, bf16) the same code runs with scale 1.0, so the engine has no
branches on the precision.

[Note: dynamic scaling] Same rule as DeepSpeed's DynamicLossScaler. An overflow first uses
up the hysteresis (`fp16.hysteresis` overflows are tolerated); once one tolerance is left,
each overflow halves the scale, never below `min_loss_scale`. The hysteresis is not refilled
by halving: it is refilled when the scale doubles, which happens when the number of good steps
since the last overflow, minus one, is a positive multiple of `loss_scale_window` (so the first
doubling comes on the window+1-th good step). With `consecutive_hysteresis` every good step
refills it. An overflow while the scale is already at its minimum and no tolerance is left
raises FloatingPointError, as DeepSpeed does: training has diverged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from infinity.config import FP16Config, check_resolved

logger = logging.getLogger(__name__)

__all__ = [
    "DynamicLossScaler",
    "LossScaler",
    "NoScaler",
    "StaticLossScaler",
    "build_loss_scaler",
    "has_overflow",
]


class LossScaler:
    """The interface: `scale`, `update(overflow)`, `state_dict()`, `load_state_dict()`."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self._scale

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome (`overflow`: non-finite gradients, step skipped)."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(self, state, ("kind", "scale"))
        self._scale = float(state["scale"])


class NoScaler(LossScaler):
    """Scale 1.0 forever: fp32 and bf16."""

    def __init__(self) -> None:
        super().__init__(1.0)


class StaticLossScaler(LossScaler):
    """A fixed scale (`fp16.loss_scale` > 0)."""


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic rule (see the module note)."""

    dynamic = True

    def __init__(
        self,
        *,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        hysteresis: int,
        consecutive_hysteresis: bool = False,
        scale_factor: float = 2.0,
        raise_at_min_scale: bool = True,
    ) -> None:
        if not init_scale > 0 or not min_scale > 0:
            raise ValueError(
                f"loss scales must be > 0, got init_scale={init_scale!r}, min_scale={min_scale!r}"
            )
        if scale_window < 1 or hysteresis < 1:
            raise ValueError(
                f"scale_window and hysteresis must be >= 1, got {scale_window!r}, {hysteresis!r}"
            )
        super().__init__(init_scale)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.scale_factor = float(scale_factor)
        self.raise_at_min_scale = raise_at_min_scale
        self.hysteresis_left = self.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.scale_window == 0:
                self.hysteresis_left = self.hysteresis
                self._scale *= self.scale_factor
        self.iteration += 1

    def _on_overflow(self) -> None:
        if self.hysteresis_left > 1:
            self.hysteresis_left -= 1
            logger.info(
                "fp16 overflow at loss scale %g: step skipped, %d more tolerated before halving",
                self._scale,
                self.hysteresis_left - 1,
            )
            return
        if self._scale <= self.min_scale and self.raise_at_min_scale:
            raise FloatingPointError(
                f"fp16 gradients overflow at the minimum loss scale {self.min_scale:g}: "
                f"training has diverged; lower the learning rate, check the data, lower "
                f"fp16.min_loss_scale, or train in bf16"
            )
        new_scale = max(self._scale / self.scale_factor, self.min_scale)
        logger.info("fp16 overflow: step skipped, loss scale %g -> %g", self._scale, new_scale)
        self._scale = new_scale

    _STATE = ("kind", "scale", "iteration", "last_overflow_iteration", "hysteresis_left")

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": type(self).__name__,
            "scale": self._scale,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(self, state, self._STATE)
        self._scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.hysteresis_left = int(state["hysteresis_left"])


def _check_state(scaler: LossScaler, state: Any, keys: tuple[str, ...]) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"{type(scaler).__name__}.load_state_dict: expected a dict, got {state!r}")
    if state.get("kind") != type(scaler).__name__:
        raise ValueError(
            f"{type(scaler).__name__}.load_state_dict: the state is from a "
            f"{state.get('kind')}; the fp16 loss-scale settings changed since the checkpoint "
            f"was written"
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(
            f"{type(scaler).__name__}.load_state_dict: missing {missing} in {sorted(state)}"
        )


def build_loss_scaler(fp16: FP16Config) -> LossScaler:
    """The scaler for `fp16`: NoScaler when disabled, static when loss_scale > 0, else dynamic."""
    check_resolved(fp16, "fp16")
    if not fp16.enabled:
        return NoScaler()
    if fp16.loss_scale < 0:
        raise ValueError(f"fp16.loss_scale: {fp16.loss_scale} is negative; use 0 for dynamic")
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )


def has_overflow(tensors: Iterable[torch.Tensor]) -> bool:
    """True when any element of any floating-point tensor is inf or NaN.

    Exact, one read of each tensor, one host synchronization for the whole list: the min and
    max of a tensor are finite only if every element is (NaN and inf propagate to them). A sum
    would be as fast but reports finite values whose total leaves the fp32 range as overflow.
    Measured against the alternatives in benchmarks/overflow_check_bench.py.
    """
    extremes = []
    for t in tensors:
        if t.numel() > 0 and t.is_floating_point():
            extremes.append(torch.stack(torch.aminmax(t)))
    if not extremes:
        return False
    first = extremes[0]
    if any(e.dtype != first.dtype or e.device != first.device for e in extremes):
        extremes = [e.to(device=first.device, dtype=torch.float32) for e in extremes]
    return not bool(torch.isfinite(torch.stack(extremes)).all())
