"""The flat Adam/AdamW step the engine's optimizer calls on each sub-group.

This module holds the reference implementation in torch and `adam_step_flat`, which checks
the buffers and dispatches to the native kernel (`infinity._cpu_adam`, same contract) or to
the reference. Both take the hyperparameters as one `AdamHyper`. State (parameter, moments)
lives in tensors the caller owns.

[Note: choosing the implementation] `backend` is "native", "torch" or "auto" (native when
built); `simd` forces a native SIMD level ("avx512bf16", "avx512vbmi", "avx512", "avx2",
"neon", "scalar") or "auto" (the fastest this CPU runs; "avx512vbmi" differs from "avx512" in
the 8-bit step's table lookup only, "avx512bf16" from "avx512vbmi" in its bf16 copy's
conversion only; all give the same bits). When an argument is None, the environment variables
INFINITY_ADAM_BACKEND and INFINITY_ADAM_SIMD decide, then "auto". A forced SIMD level needs the
native kernel, so it is an error when the kernel is not built rather than a silent fallback.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from infinity.optim import native_adam
from infinity.optim.hyper import AdamHyper, hyper_from

BACKENDS = ("auto", "native", "torch")


def adam_step_flat_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamHyper | None = None,
    grad_scale: float = 1.0,
    half_out: torch.Tensor | None = None,
    **fields: Any,
) -> None:
    """One Adam step over flat fp32 `param`, `exp_avg`, `exp_avg_sq` (all 1-D, same numel).

    `hyper` holds the hyperparameters; instead of it, its fields may be given as keywords
    (`lr=...`, `weight_decay=...`). `grad` may be fp32, fp16 or bf16; it is multiplied by
    `grad_scale` first (the product of 1/loss_scale and the clipping coefficient). `step` is
    the 1-based step count after this update. If `half_out` (fp16 or bf16, same numel) is
    given, the new parameter is written into it rounded to nearest-even.
    """
    h = hyper_from(hyper, fields)
    g = grad.to(torch.float32)
    if grad_scale != 1.0:
        g = g * grad_scale
    if h.weight_decay != 0.0:
        if h.adamw_mode:
            param.mul_(1.0 - h.lr * h.weight_decay)
        else:
            g = g.add(param, alpha=h.weight_decay)
    exp_avg.lerp_(g, 1.0 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
    bc1 = 1.0 - h.beta1**step if h.bias_correction else 1.0
    bc2 = 1.0 - h.beta2**step if h.bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-h.lr / bc1)
    if half_out is not None:
        half_out.copy_(param)


def resolve_backend(backend: str | None = None, simd: str | None = None) -> tuple[str, str]:
    """The (backend, simd) a call would use: "native" or "torch", and the SIMD request."""
    backend = backend if backend is not None else os.environ.get("INFINITY_ADAM_BACKEND", "auto")
    simd = simd if simd is not None else os.environ.get("INFINITY_ADAM_SIMD", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if simd not in native_adam.SIMD_CHOICES:
        raise ValueError(f"simd={simd!r} is not one of {', '.join(native_adam.SIMD_CHOICES)}")
    if backend == "auto":
        if native_adam.available():
            backend = "native"
        elif simd != "auto":
            raise ValueError(
                f"simd={simd!r} needs the native kernel, but infinity._cpu_adam is not built; "
                f"{native_adam.BUILD_HINT}, or leave simd='auto'"
            )
        else:
            backend = "torch"
    elif backend == "native" and not native_adam.available():
        raise ValueError(
            f"backend='native' but infinity._cpu_adam is not built; {native_adam.BUILD_HINT}, "
            "or pass backend='torch'"
        )
    return backend, simd


def adam_step_flat(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamHyper | None = None,
    grad_scale: float = 1.0,
    half_out: torch.Tensor | None = None,
    backend: str | None = None,
    simd: str | None = None,
    **fields: Any,
) -> None:
    """`adam_step_flat_reference`'s contract, on the native kernel when available.

    Buffers are checked first, for every backend: CPU, dense, contiguous, same numel, fp32
    state, fp32/fp16/bf16 `grad`, fp16/bf16 `half_out`, no shared memory between them
    (TypeError/ValueError otherwise). See [Note: choosing the implementation] for `backend`
    and `simd`.
    """
    h = hyper_from(hyper, fields)
    native_adam.check_buffers(param, grad, exp_avg, exp_avg_sq, half_out, step)
    backend, simd = resolve_backend(backend, simd)
    per_step = dict(step=step, hyper=h, grad_scale=grad_scale, half_out=half_out)
    if backend == "native":
        native_adam.adam_step_native(param, grad, exp_avg, exp_avg_sq, simd=simd, **per_step)
        return
    with torch.no_grad():  # buffers may be leaves that require grad (nn.Parameter)
        adam_step_flat_reference(param, grad, exp_avg, exp_avg_sq, **per_step)
