"""fp32 gradient sums kept on the device across micro batches: `DeviceGradTier`.

Holds the sums of some sub-groups in one flat fp32 buffer on the accelerator's device, so a
gradient whose sub-groups are all here is added where backward made it: no copy to the host
in backward, and no disk traffic at any micro batch. The step reads each sub-group to the
host for the norm and again for CPU-Adam, into a host buffer of two sub-groups (pinned where
the device pins): the norm's pass copies the next sub-group into one half while it measures
the other (see [Note: the norm's copies run ahead]). It owns that buffer and the device
buffer; it does not decide which sub-groups are here (`offload_optimizer.
gradients_on_device`, the placement planner's key) nor route the gradients to it (the
optimizer's `device_slots` tells the hooks which slots to add on the device).

[Note: the same bits on the device] An fp32 add of a 16-bit or fp32 gradient is exact
elementwise rounding on every device, so the sums equal the host tier's bit for bit. The
norm is not computed on the device (a reduction's order differs from the host's): each
sub-group is copied to the host and measured there by rows, exactly as `HostGradTier` does,
so the global norm, the clip and every update are the same wherever the sums live.

[Note: the norm's copies run ahead] `sums_of_squares` issues the copy of sub-group g + 1 to
one half of the host buffer before it measures sub-group g in the other, and waits for a
copy's event only before measuring it: on a GPU the copy engine and the host's norm pass
run side by side, so the pass costs the slower of the two rather than their sum (the
estimate counts it so). The values are the same bits: each sub-group is measured by the same
function from the same copied sums, and the list is in index order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infinity.accelerator import Accelerator
from infinity.swap.grad_tier import add_into, sum_of_squares
from infinity.utils.exact_sum import ExactSum
from infinity.utils.sizes import FP32_BYTES


def device_grad_bytes(numels: Sequence[int]) -> tuple[int, int]:
    """`DeviceGradTier`'s bytes over sub-groups of `numels`: (device, host: two of the
    largest sub-group, see [Note: the norm's copies run ahead])."""
    return FP32_BYTES * sum(numels), 2 * FP32_BYTES * max(numels, default=0)


class DeviceGradTier:
    """The sums of sub-groups of `numels` in one flat fp32 device buffer, allocated at first
    use (see [Note: the same bits on the device])."""

    def __init__(self, numels: Sequence[int], accelerator: Accelerator) -> None:
        self.numels = list(numels)
        self.accel = accelerator
        _, self.host_bytes = device_grad_bytes(self.numels)
        self._starts = [0]
        for n in self.numels:
            self._starts.append(self._starts[-1] + n)
        self._flat: torch.Tensor | None = None
        self._host: torch.Tensor | None = None

    def _view(self, index: int) -> torch.Tensor:
        if self._flat is None:
            self._flat = self.accel.empty((self._starts[-1],), torch.float32)
            self._flat.zero_()
        return self._flat[self._starts[index] : self._starts[index + 1]]

    def add(self, index: int, start: int, src: torch.Tensor) -> None:
        """Elements [start, start + src.numel()) of sub-group `index` += src (a host `src`,
        a slot that straddles into the host tiers, is copied here first)."""
        dst = self._view(index)[start : start + src.numel()]
        if src.device != dst.device:
            src = self.accel.to_device(src)
        if dst.device.type == "cpu":
            add_into(dst, src)
        else:  # one kernel: the piecewise add only spares the host allocator
            dst.add_(src)

    def sums_of_squares(self) -> list[ExactSum]:
        """One value per sub-group, in order, measured on the host (see [Note: the norm's
        copies run ahead])."""
        count, out = len(self.numels), []
        if count:
            landed = self._copy_ahead(0)
        for g in range(count):
            nxt = self._copy_ahead(g + 1) if g + 1 < count else None
            landed.synchronize()
            out.append(sum_of_squares(self._half(g)))
            landed = nxt
        return out

    def _half(self, index: int) -> torch.Tensor:
        """The half of the host buffer that sub-group `index`'s copy goes to."""
        if self._host is None:
            numel = self.host_bytes // FP32_BYTES
            if self.accel.pin_supported():
                self._host = self.accel.empty_pinned((numel,), torch.float32)
            else:
                self._host = torch.empty(numel, dtype=torch.float32)
        half = self._host.numel() // 2
        start = (index % 2) * half
        return self._host[start : start + self.numels[index]]

    def _copy_ahead(self, index: int):
        """Start copying sub-group `index` to its half; the event to wait for before
        reading it."""
        self.accel.to_host(self._view(index), out=self._half(index))
        event = self.accel.new_event()
        event.record(self.accel.current_stream())
        return event

    def take(self, index: int) -> torch.Tensor:
        """Sub-group `index`'s sum, copied into the host buffer: valid until the next
        `take` or `sums_of_squares`."""
        out = self._half(0)[: self.numels[index]]
        self.accel.to_host(self._view(index), out=out)
        if out.is_pinned():  # an asynchronous copy: the host reads it next
            self.accel.current_stream().synchronize()
        return out

    def release(self, index: int) -> None:
        """The step is done with sub-group `index`: it reads as zeros from now on."""
        self._view(index).zero_()

    def zero(self) -> None:
        if self._flat is not None:
            self._flat.zero_()

    @property
    def on_device(self) -> int:
        """Every sub-group here sums on the device."""
        return len(self.numels)

    def host_resident(self) -> list[bool]:
        return [False] * len(self.numels)

    def host_flat(self) -> None:
        return None

    def close(self) -> None:
        """Gives the device buffer back."""
        self._flat = self._host = None

    def memory_stats(self) -> dict[str, int]:
        return {
            "grad_host_bytes": 0 if self._host is None else self._host.nbytes,
            "grad_device_bytes": 0 if self._flat is None else self._flat.nbytes,
        }
