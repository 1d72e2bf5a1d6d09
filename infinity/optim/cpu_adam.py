"""CPUAdam: a standalone torch.optim.Optimizer running the flat Adam/AdamW step on CPU tensors.

For code that wants CPU-Adam on its own model, outside the engine: the engine does not use it
(its optimizer is `infinity.zero.PartitionedOptimizer`, which calls `adam_step_flat` on its
own flat sub-groups). Owns the per-parameter state (step count, exp_avg, exp_avg_sq) and the param
groups; the math is `adam_step_flat` (native kernel, or the torch reference with
`backend="torch"`), with each group's hyperparameters as one `AdamHyper`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from infinity.optim.functional import adam_step_flat, resolve_backend
from infinity.optim.hyper import AdamHyper


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
        AdamHyper.of(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )  # checks the defaults even when every group overrides them
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
        AdamHyper.of_group(self.param_groups[-1])  # raises on a bad value

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
            hyper = AdamHyper.of_group(group)  # a group's lr may change between steps
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
                    hyper=hyper,
                    grad_scale=grad_scale,
                    backend=self.backend,
                    simd=self.simd,
                )
                state["step"] = step
        return loss
