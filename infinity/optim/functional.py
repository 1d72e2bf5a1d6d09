"""The flat Adam/AdamW step the engine calls on each optimizer sub-group.

This module holds the reference implementation in torch. The native kernel
(`infinity._cpu_adam`) implements the same contract; `infinity.optim.cpu_adam` dispatches
between them. State (parameter, moments) lives in tensors the caller owns.
"""

from __future__ import annotations

import math

import torch


def adam_step_flat_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    half_out: torch.Tensor | None = None,
) -> None:
    """One Adam step over flat fp32 `param`, `exp_avg`, `exp_avg_sq` (all 1-D, same numel).

    `grad` may be fp32, fp16 or bf16; it is multiplied by `grad_scale` first (the product of
    1/loss_scale and the clipping coefficient). `step` is the 1-based step count after this
    update. If `half_out` (fp16 or bf16, same numel) is given, the new parameter is written
    into it rounded to nearest-even.
    """
    g = grad.to(torch.float32)
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0.0:
        if adamw_mode:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if half_out is not None:
        half_out.copy_(param)


# Until the native kernel is wired in, the reference is the implementation.
adam_step_flat = adam_step_flat_reference
