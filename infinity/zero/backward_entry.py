"""Where gradients enter a partitioned model: the start and the end of every backward.

`BackwardEntry.wrap` marks a forward's outputs so that the first gradient reaching one
begins the coordinator's backward and queues its end for when autograd finishes; the
module hooks hand it the first gradient that reaches a module's outputs instead, so
`enter` is the one place a backward begins, for `engine.backward(loss)` and a plain
`loss.backward()` alike. Without
loss scaling a tensor hook on each output does it and the outputs are returned untouched.
With fp16 the gradient must also be multiplied by the loss scale exactly once, so each
output is passed through an identity function whose backward scales: scalars (the loss)
come back as copies, larger outputs as aliases, which cannot be modified in place (clone
them first). See [Note: plain backward] in infinity/engine.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from infinity.utils.step_timer import StepTimer
from infinity.zero.coordinator import Coordinator


class _EntryFunction(torch.autograd.Function):
    """Identity forward; backward hands the gradient to `BackwardEntry.enter` for its scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, entry: BackwardEntry) -> torch.Tensor:
        ctx.entry = entry
        # A copy of a scalar costs nothing and may be modified in place (the HF Trainer
        # does `loss *= ...`); logits can be gigabytes, so they get an alias.
        return x.clone() if x.numel() <= 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        factor = ctx.entry.enter()
        return (grad if factor == 1.0 else grad * factor), None


class BackwardEntry:
    """The gradient's way into one engine's model, for `loss.backward()` and
    `engine.backward(loss)` alike."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        loss_scale: Callable[[], float] | None,
        timer: StepTimer | None = None,
    ) -> None:
        """`loss_scale` returns the current fp16 loss scale (None: no loss scaling). `timer`
        gets the time of each plain `loss.backward()` as "backward" (from the first gradient
        reaching an output to autograd's end; `engine.backward` times itself)."""
        self.coord = coordinator
        self.loss_scale = loss_scale
        self.caller_scaled = False
        """True inside `engine.backward`, which scaled the loss itself."""
        self.timer = timer
        self._started = False
        self._timed: float | None = None
        self.finished = 0
        """Backwards autograd has finished through the outputs (the engine resets it)."""
        # A backward that failed half-way must not keep its state into the next iteration.
        coordinator.on_end.append(self._forget)

    def _forget(self) -> None:
        self._started = False
        self._timed = None

    @contextlib.contextmanager
    def scaled_by_caller(self) -> Iterator[None]:
        """`engine.backward`'s autograd run inside: it scaled the loss itself, and times
        itself."""
        self.caller_scaled = True
        try:
            yield
        finally:
            self.caller_scaled = False

    def wrap(self, out: Any) -> Any:
        """`out` with each tensor that requires grad (in tuples, lists, dicts, HF
        ModelOutputs) replaced by its entry alias."""
        if isinstance(out, torch.Tensor):
            if not out.requires_grad or isinstance(out, nn.Parameter):
                return out
            if self.loss_scale is None:
                out.register_hook(self._on_grad)
                return out
            return _EntryFunction.apply(out, self)
        if isinstance(out, dict):  # ModelOutput too: its __setitem__ keeps attributes in step
            for key in list(out.keys()):
                out[key] = self.wrap(out[key])
            return out
        if isinstance(out, tuple):
            items = [self.wrap(x) for x in out]
            return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
        if isinstance(out, list):
            return [self.wrap(x) for x in out]
        return out

    def enter(self) -> float:
        """A gradient reached an output: the first one of a backward starts it. Returns the
        factor for the gradient (the loss scale, or 1 when the caller already scaled)."""
        if not self._started:
            self.coord.begin_backward()  # the one caller: see the module's docstring
            self._started = True
            if self.timer is not None and not self.caller_scaled:
                self._timed = self.timer.start()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if self.caller_scaled or self.loss_scale is None:
            return 1.0
        return float(self.loss_scale())

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.enter()

    def _finish(self) -> None:
        """Autograd has finished the backward: the iteration ends (which resets the hooks
        and this entry, see `Coordinator.on_end`)."""
        timed = self._timed
        self._forget()
        self.finished += 1
        self.coord.end_backward()
        if timed is not None:
            self.timer.stop("backward", timed)  # type: ignore[union-attr]
