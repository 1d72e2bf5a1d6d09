"""fp32 gradient sums kept on the device across micro batches: `DeviceGradTier`.

Holds the sums of some sub-groups in one flat fp32 buffer on the accelerator's device, so a
gradient whose sub-groups are all here is added where backward made it: no copy to the host
in backward, and no disk traffic at any micro batch. The step reads each sub-group to the
host, into one host buffer (pinned where the device pins), for the norm and again for
CPU-Adam. It owns that buffer and the device buffer; it does not decide which sub-groups
are here (`offload_optimizer.gradients_on_device`, the placement planner's key) nor route
the gradients to it (the optimizer's `device_slots` tells the hooks which slots to add on
the device).

[Note: the same bits on the device] An fp32 add of a 16-bit or fp32 gradient is exact
elementwise rounding on every device, so the sums equal the host tier's bit for bit. The
norm is not computed on the device (a reduction's order differs from the host's): each
sub-group is copied to the host and measured there by rows, exactly as `HostGradTier` does,
so the global norm, the clip and every update are the same wherever the sums live.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infinity.accelerator import Accelerator
from infinity.swap.grad_plan import FP32_NBYTES
from infinity.swap.grad_tier import add_into, sum_of_squares


def device_grad_bytes(numels: Sequence[int]) -> tuple[int, int]:
    """`DeviceGradTier`'s bytes over sub-groups of `numels`: (device, host)."""
    return FP32_NBYTES * sum(numels), FP32_NBYTES * max(numels, default=0)


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

    def sums_of_squares(self) -> list[float]:
        """One value per sub-group, in order, measured on the host."""
        return [sum_of_squares(self.take(g)) for g in range(len(self.numels))]

    def take(self, index: int) -> torch.Tensor:
        """Sub-group `index`'s sum, copied into the host buffer: valid until the next
        `take` or `sums_of_squares`."""
        if self._host is None:
            numel = self.host_bytes // FP32_NBYTES
            if self.accel.pin_supported():
                self._host = self.accel.empty_pinned((numel,), torch.float32)
            else:
                self._host = torch.empty(numel, dtype=torch.float32)
        out = self._host[: self.numels[index]]
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
