"""The flat Adam/AdamW step with 8-bit blockwise moments: the torch reference and the checked
dispatch to the native kernel (`infinity._cpu_adam.adam8_step`, same contract).

The master weights stay fp32; exp_avg and exp_avg_sq are uint8 codes with one fp32 absmax
per block of `BLOCK` elements (see [Note: the 8-bit scheme] in quant8.py). One step
dequantizes a block's moments, runs exactly the fp32 Adam of `adam_step_flat_reference` on
them (the parameter update uses the new fp32 moments, before they are rounded), and
quantizes them again with the block's new absmax. State lives in tensors the caller owns.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from infinity.optim import native_adam
from infinity.optim.functional import resolve_backend
from infinity.optim.hyper import AdamHyper, hyper_from
from infinity.optim.quant8 import block_count, dequantize, quantize, tables


def adam8_step_flat_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    *,
    step: int,
    hyper: AdamHyper | None = None,
    grad_scale: float = 1.0,
    half_out: torch.Tensor | None = None,
    **fields: Any,
) -> None:
    """One 8-bit Adam step over flat fp32 `param` (n elements), uint8 `exp_avg` /
    `exp_avg_sq` (n codes) and their fp32 absmax ([ceil(n / BLOCK)] each), in place.

    The rest of the contract is `adam_step_flat_reference`'s (grad dtypes, `grad_scale`,
    `step`, `half_out`).
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
    m = dequantize(exp_avg, exp_avg_absmax, signed=True)
    v = dequantize(exp_avg_sq, exp_avg_sq_absmax, signed=False)
    m.lerp_(g, 1.0 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
    bc1 = 1.0 - h.beta1**step if h.bias_correction else 1.0
    bc2 = 1.0 - h.beta2**step if h.bias_correction else 1.0
    denom = (v.sqrt() / math.sqrt(bc2)).add_(h.eps)
    param.addcdiv_(m, denom, value=-h.lr / bc1)
    if half_out is not None:
        half_out.copy_(param)
    for codes, absmax, x, signed in (
        (exp_avg, exp_avg_absmax, m, True),
        (exp_avg_sq, exp_avg_sq_absmax, v, False),
    ):
        new_codes, new_absmax = quantize(x, signed)
        codes.copy_(new_codes)
        absmax.copy_(new_absmax)


def adam8_step_flat(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    *,
    step: int,
    hyper: AdamHyper | None = None,
    grad_scale: float = 1.0,
    half_out: torch.Tensor | None = None,
    backend: str | None = None,
    simd: str | None = None,
    **fields: Any,
) -> None:
    """`adam8_step_flat_reference`'s contract, on the native kernel when available (buffers
    checked first, for every backend; `backend` and `simd` as `adam_step_flat`'s)."""
    h = hyper_from(hyper, fields)
    moments = (exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax)
    check_buffers8(param, grad, *moments, half_out, step)
    backend, simd = resolve_backend(backend, simd)
    per_step = dict(step=step, hyper=h, grad_scale=grad_scale, half_out=half_out)
    if backend == "native":
        tables8 = native_tables()
        native_adam.adam8_step_native(param, grad, *moments, tables=tables8, simd=simd, **per_step)
        return
    with torch.no_grad():
        adam8_step_flat_reference(param, grad, *moments, **per_step)


def check_buffers8(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    half_out: torch.Tensor | None,
    step: int,
) -> None:
    """Raises TypeError/ValueError unless the buffers are valid for one flat 8-bit Adam step:
    `check_buffers`' rules, uint8 codes of the parameters' numel, fp32 absmax of one per
    block."""
    n = param.numel() if isinstance(param, torch.Tensor) else 0
    u8, f32 = (torch.uint8,), (torch.float32,)
    specs = {
        "param": (param, f32, n),
        "grad": (grad, tuple(native_adam.GRAD_DTYPES), n),
        "exp_avg": (exp_avg, u8, n),
        "exp_avg_sq": (exp_avg_sq, u8, n),
        "exp_avg_absmax": (exp_avg_absmax, f32, block_count(n)),
        "exp_avg_sq_absmax": (exp_avg_sq_absmax, f32, block_count(n)),
    }
    if half_out is not None:
        specs["half_out"] = (half_out, tuple(native_adam.HALF_DTYPES), n)
    native_adam.check_flat(specs, step)


def native_tables() -> tuple[torch.Tensor, ...]:
    """The eight tables the kernel reads: (qmap, codes, tree, index) of the signed then the
    unsigned map."""
    return (*tables(True), *tables(False))
