"""The gradients of a one-micro-batch window kept as backward made them: `HalfGradTier`.

With gradient_accumulation_steps 1 and fp16/bf16 weights, the fp32 sum of a slot's
gradients is one 16-bit gradient converted, and CPU-Adam converts a 16-bit gradient itself.
So this tier keeps each gradient as it came (2 bytes per element instead of 4), copies it in
instead of adding it to a zeroed fp32 buffer, and never zeroes: a range no gradient reached
since the last step is zeroed when the step first reads its sub-group. It has the
`HostGradTier` contract and owns one flat 16-bit host buffer; it does not know the slots.

[Note: 16-bit gradient sums] Why the bits are those of the fp32 sums. Converting fp16 or bf16
to fp32 is exact, so 0 + g (the fp32 sum of one gradient) equals g converted, except that
-0 becomes +0; the global norm squares it, and Adam's update (the moments' lerp with
beta1 > 0.5, the square, the step) gives the same bits for a zero gradient of either sign.
The norm is computed from the fp32 conversion of each sub-group, by the same rows as
`HostGradTier`. A second gradient into a range already written (two backward passes before a
step, a reduce-scatter's fp32 mean) turns that sub-group into an fp32 sum at once, made from
the exact conversion of what it held: from then on it is what `HostGradTier` would hold.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from infinity.swap.grad_tier import add_into, sum_of_squares
from infinity.utils.exact_sum import ExactSum

HALF_DTYPES = (torch.float16, torch.bfloat16)


def keeps_half(
    half_gradients: bool, accum: int, dtype: torch.dtype | None, world_size: int
) -> bool:
    """Whether a run keeps its gradients in 16 bits (`HalfGradTier`), where every sum is in
    host memory: `offload_optimizer.half_gradients`, one micro batch a step, fp16/bf16
    slots, one rank (several ranks add reduce-scattered fp32 means). The one rule the
    engine and the estimate share."""
    return bool(half_gradients) and accum == 1 and dtype in HALF_DTYPES and world_size == 1


class HalfGradTier:
    """Every sub-group's gradient in one flat 16-bit host buffer (see [Note: 16-bit
    gradient sums]); a sub-group that receives a second gradient before the step is summed
    in fp32 from then on."""

    on_device = 0

    def __init__(self, numels: Sequence[int], dtype: torch.dtype) -> None:
        if dtype not in HALF_DTYPES:
            raise ValueError(f"HalfGradTier keeps fp16 or bf16 gradients, not {dtype}")
        self.numels = list(numels)
        self.dtype = dtype
        self._starts = [0]
        for n in self.numels:
            self._starts.append(self._starts[-1] + n)
        self._flat: torch.Tensor | None = None
        self._alloc = threading.Lock()  # the step's worker may read a sub-group first
        self._written: list[dict[int, int]] = [{} for _ in self.numels]
        """Per sub-group, the ranges written since the last step: start -> stop."""
        self._settled = [False] * len(self.numels)
        self._wide: dict[int, torch.Tensor] = {}
        """Sub-groups summed in fp32 (a second gradient reached them)."""

    def _view(self, index: int) -> torch.Tensor:
        if self._flat is None:
            with self._alloc:
                if self._flat is None:
                    self._flat = torch.zeros(self._starts[-1], dtype=self.dtype)
        return self._flat[self._starts[index] : self._starts[index + 1]]

    def add(self, index: int, start: int, src: torch.Tensor) -> None:
        """Elements [start, start + src.numel()) of sub-group `index` += src."""
        stop = start + src.numel()
        wide = self._wide.get(index)
        written = self._written[index]
        fresh = not any(a < stop and start < b for a, b in written.items())
        if wide is None and fresh and src.dtype == self.dtype and src.device.type == "cpu":
            self._view(index)[start:stop].copy_(src)
            written[start] = stop
            return
        if wide is None:
            wide = self._widen(index)
        add_into(wide[start:stop], src)

    def _widen(self, index: int) -> torch.Tensor:
        wide = torch.zeros(self.numels[index], dtype=torch.float32)
        view = self._view(index)
        for a, b in self._written[index].items():
            wide[a:b].copy_(view[a:b])  # exact
        self._wide[index] = wide
        return wide

    def _settle(self, index: int) -> torch.Tensor:
        """Sub-group `index` as the step reads it: the ranges no gradient reached zeroed."""
        view = self._view(index)
        if not self._settled[index]:
            at = 0
            for a, b in sorted(self._written[index].items()):
                view[at:a].zero_()
                at = b
            view[at:].zero_()
            self._settled[index] = True
        return view

    def sums_of_squares(self) -> list[ExactSum]:
        """One value per sub-group, in order, as `HostGradTier` computes them."""
        out = []
        for g in range(len(self.numels)):
            wide = self._wide.get(g)
            out.append(sum_of_squares(wide if wide is not None else self._settle(g).float()))
        return out

    def take(self, index: int) -> torch.Tensor:
        """Sub-group `index`'s gradient for the step: [numel] fp32, or 16-bit as it came."""
        wide = self._wide.get(index)
        return wide if wide is not None else self._settle(index)

    def release(self, index: int) -> None:
        """The step is done with sub-group `index`: it reads as zeros from now on (its
        bytes are overwritten or zeroed when the next step reads them)."""
        self._written[index].clear()
        self._settled[index] = False
        self._wide.pop(index, None)

    def zero(self) -> None:
        for g in range(len(self.numels)):
            self.release(g)

    def host_resident(self) -> list[bool]:
        return [True] * len(self.numels)

    def host_flat(self) -> None:
        """None: the sums are 16-bit until a second gradient widens a sub-group."""
        return None

    def close(self) -> None:
        """Nothing outstanding."""

    def memory_stats(self) -> dict[str, int]:
        held = (0 if self._flat is None else self._flat.nbytes) + sum(
            t.nbytes for t in self._wide.values()
        )
        return {"grad_host_bytes": held}
