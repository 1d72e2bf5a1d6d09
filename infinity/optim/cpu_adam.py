"""CPUAdam: a torch.optim.Optimizer running the flat Adam/AdamW step on CPU tensors.

Owns the per-parameter state (step count, exp_avg, exp_avg_sq) and the param groups; the math
is `adam_step_flat` (native kernel, or the torch reference with `backend="torch"`). It does not
own offload or swapping: the engine calls `adam_step_flat` on its own flat buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from infinity.optim.functional import adam_step_flat, resolve_backend


class CPUAdam(torch.optim.Optimizer):
    """Adam (`adamw_mode=False`, L2 weight decay) or AdamW (decoupled decay) on CPU tensors.

    Matches torch.optim.Adam / AdamW (foreach=False) to within rounding. Parameters must be
    contiguous fp32 CPU tensors; gradients may be fp32, fp16 or bf16. `backend` and `simd`
    choose the implementation (see infinity.optim.functional); `backend="torch"` is the pure
    torch fallback with the same API.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        *,
        backend: str | None = None,
        simd: str | None = None,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        self.backend, self.simd = resolve_backend(backend, simd)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict comes through here: accept the groups of torch.optim.Adam/AdamW.
        super().__setstate__(state)
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError(
                    "the state dict has amsgrad or maximize set, which CPUAdam does not "
                    "implement; load it into torch.optim.Adam/AdamW instead"
                )
            decoupled = group.get("decoupled_weight_decay", self.defaults["adamw_mode"])
            group.setdefault("adamw_mode", decoupled)
            group.setdefault("bias_correction", self.defaults["bias_correction"])

    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0
    ) -> float | None:
        """One step over every parameter with a gradient.

        `grad_scale` multiplies every gradient first (1/loss_scale times the clipping
        coefficient), fused into the same pass.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                # torch's own optimizers keep the step as a tensor: accept both when loading.
                step = int(state["step"]) + 1
                adam_step_flat(
                    p,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=step,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adamw_mode=group["adamw_mode"],
                    bias_correction=group["bias_correction"],
                    grad_scale=grad_scale,
                    backend=self.backend,
                    simd=self.simd,
                )
                state["step"] = step
        return loss


def _check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
