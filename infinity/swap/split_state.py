"""Optimizer state split between host memory and NVMe: `SplitStateTier`, and the gradients
that follow it, `SplitGradTier`.

The first sub-groups whose state fits in `offload_optimizer.max_in_cpu` elements stay in host
memory (a `HostStateTier` over them, stepped in place), the rest are swept from NVMe (an
`NvmeStateTier` over them). Which sub-groups go where is `ram_sub_groups`, the one rule the
engine and the estimate share; it does not decide how much RAM to spend (the placement
planner, `infinity.placement`, does).

The gradients of the sub-groups kept in RAM stay in RAM too (`SplitGradTier`: a
`HostGradTier` over them, an `NvmeGradTier` over the rest), unless
`offload_optimizer.gradients_in_cpu` keeps all of them there; the first sub-groups
`offload_optimizer.gradients_on_device` holds keep theirs on the device (`grad_split`).

[Note: host sub-groups between NVMe ones] A sweep in the default order steps the host
sub-groups in between the NVMe ones, spread evenly (`interleaved_order`: an NVMe one first,
then host ones in proportion), so the disk is never idle while the cores step host state: the
NVMe tier's reads run ahead along its own order (its first ones were issued at the end of the
previous sweep and landed during forward and backward) while host sub-groups are stepped, and
each NVMe sub-group's write-back is issued when the next one is asked for. A sweep that
stepped every host sub-group first would leave the disk idle for their whole CPU-Adam (a
third of the step's Adam in a 13B plan that keeps 64% of its state in RAM) and then run the
NVMe part alone, where the estimate counts the slower of the two side by side. Where a
sub-group lives, and the order the sweep visits them in, change no value: the same Adam
kernel steps the same fp32 numbers in any order (sub-groups are independent; the norm is
summed before the sweep, in index order), and a checkpoint reads and writes each sub-group
through whichever tier holds it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence

from infinity.config.sections import OffloadOptimizerConfig
from infinity.swap.grad_tier import GradTier
from infinity.swap.nvme_state import NvmeStateTier
from infinity.swap.state_tier import HostStateTier, SubGroupState, SubGroupState8, sweep_order
from infinity.utils.exact_sum import ExactSum


def ram_sub_groups(numels: Sequence[int], max_in_cpu: int) -> int:
    """How many of the first sub-groups (of `numels` elements) fit whole in `max_in_cpu`
    elements of host state."""
    room, count = int(max_in_cpu), 0
    for n in numels:
        if n > room:
            break
        room -= n
        count += 1
    return count


def state_in_ram(numels: Sequence[int], offload: OffloadOptimizerConfig) -> int:
    """Sub-groups whose state lives in host memory under `offload`: all of them unless the
    device is "nvme", else those `max_in_cpu` keeps. The gradients spill to NVMe only when
    some state does (`make_grad_tier`), and fp32 weights alias the masters only when all of
    it is in RAM."""
    if offload.device != "nvme":
        return len(numels)
    return ram_sub_groups(numels, offload.max_in_cpu)


def interleaved_order(in_ram: int, count: int) -> list[int]:
    """Sub-groups [0, count) with the host ones [0, in_ram) spread evenly between the NVMe
    ones [in_ram, count), each tier in ascending order, an NVMe one first (see [Note: host
    sub-groups between NVMe ones])."""
    nvme = count - in_ram
    if in_ram <= 0 or nvme <= 0:
        return list(range(count))
    order, host, disk = [], 0, 0
    while disk < nvme or host < in_ram:
        # The tier further behind its share goes next (cross-multiplied: no float ties).
        if disk < nvme and (host >= in_ram or disk * in_ram <= host * nvme):
            order.append(in_ram + disk)
            disk += 1
        else:
            order.append(host)
            host += 1
    return order


def gradients_spill(numels: Sequence[int], offload: OffloadOptimizerConfig) -> bool:
    """Whether the fp32 gradients go through the NVMe gradient tier: when some state is on
    NVMe, unless `offload.gradients_in_cpu` keeps them all in RAM."""
    return state_in_ram(numels, offload) < len(numels) and not offload.gradients_in_cpu


class SplitStateTier:
    """Sub-groups [0, k) in host memory, [k, n) on NVMe (see [Note: host sub-groups between
    NVMe ones])."""

    def __init__(
        self,
        numels: Sequence[int],
        in_ram: int,
        make_nvme: Callable[[list[int]], NvmeStateTier],
    ) -> None:
        self.numels = list(numels)
        if not 0 < in_ram < len(self.numels):
            raise ValueError(
                f"SplitStateTier: {in_ram} of {len(self.numels)} sub-groups in host memory; "
                "a split needs some in each tier (use HostStateTier or NvmeStateTier)"
            )
        self.in_ram = in_ram
        self.nvme = make_nvme(self.numels[in_ram:])
        self.format = self.nvme.format
        self.host = HostStateTier(self.numels[:in_ram], self.format)
        self.stats = self.nvme.stats

    def _tier(self, index: int) -> tuple[HostStateTier | NvmeStateTier, int]:
        if not 0 <= index < len(self.numels):
            raise IndexError(f"sub-group {index} out of range (there are {len(self.numels)})")
        if index < self.in_ram:
            return self.host, index
        return self.nvme, index - self.in_ram

    def initialize(self, index: int, master) -> None:
        tier, i = self._tier(index)
        tier.initialize(i, master)

    def sweep(
        self, order: Sequence[int] | None = None
    ) -> Iterator[tuple[int, SubGroupState | SubGroupState8]]:
        """In `order` (default: `interleaved_order`): the NVMe ones go through one pipelined
        sweep of the NVMe tier, in their relative order."""
        k = self.in_ram
        if order is None:
            order = interleaved_order(k, len(self.numels))
        order = sweep_order(order, len(self.numels))
        swept = self.nvme.sweep([i - k for i in order if i >= k])
        try:
            for i in order:
                if i < k:
                    yield i, self.host.resident(i)
                else:
                    j, state = next(swept)
                    yield k + j, state
            for _ in swept:  # exhausted: the NVMe tier's last write-backs are waited for
                pass
        finally:  # a sweep left early (an exception) unwinds the NVMe pipeline at once
            swept.close()

    def read(self, index: int) -> SubGroupState | SubGroupState8:
        tier, i = self._tier(index)
        return tier.read(i)

    def write(self, index: int, state: SubGroupState | SubGroupState8) -> None:
        tier, i = self._tier(index)
        tier.write(i, state)

    def read_range(self, index: int, field: str, start: int, stop: int):
        tier, i = self._tier(index)
        return tier.read_range(i, field, start, stop)

    def close(self) -> None:
        self.nvme.close()

    def memory_stats(self) -> dict[str, int]:
        """The NVMe tier's figures, and the host sub-groups' state bytes."""
        return {
            **self.nvme.memory_stats(),
            "optim_host_state_bytes": self.host.nbytes,
        }


def grad_split(numels: Sequence[int], offload: OffloadOptimizerConfig) -> tuple[int, int]:
    """Where the fp32 gradient sums of sub-groups of `numels` live: (d, k) with [0, d) on the
    device (`gradients_on_device` keeps the first that fit), [d, k) in host memory and [k, n)
    spilled to NVMe (those whose state is on NVMe, when `gradients_spill`). The one rule the
    engine (`make_grad_tier`) and the estimate share."""
    on_device = ram_sub_groups(numels, offload.gradients_on_device)
    spill = gradients_spill(numels, offload)
    return on_device, max(on_device, state_in_ram(numels, offload)) if spill else len(numels)


class SplitGradTier:
    """The fp32 gradients split over tiers by sub-group, in order: each part a tier over the
    next `count` sub-groups (device, host, NVMe; see `grad_split`), the same contract as
    any one of them."""

    def __init__(self, numels: Sequence[int], parts: Sequence[tuple[int, GradTier]]) -> None:
        self.numels = list(numels)
        if sum(count for count, _ in parts) != len(self.numels) or len(parts) < 2:
            raise ValueError(
                f"SplitGradTier: parts of {[c for c, _ in parts]} sub-groups for "
                f"{len(self.numels)}; a split needs two tiers or more that cover them all"
            )
        self.parts = [tier for _, tier in parts]
        self._first = [0]
        for count, _ in parts:
            self._first.append(self._first[-1] + count)
        self.on_device = self.parts[0].on_device
        """How many of the first sub-groups sum on the device (a `DeviceGradTier` part)."""

    def _tier(self, index: int) -> tuple[GradTier, int]:
        if not 0 <= index < len(self.numels):
            raise IndexError(f"sub-group {index} out of range (there are {len(self.numels)})")
        k = bisect.bisect_right(self._first, index) - 1
        return self.parts[k], index - self._first[k]

    def tier_of(self, index: int) -> GradTier:
        """The tier that holds sub-group `index`'s sums."""
        return self._tier(index)[0]

    def add(self, index: int, start: int, src) -> None:
        tier, i = self._tier(index)
        if not tier.on_device and src.device.type != "cpu":
            src = src.cpu()  # a slot that straddles out of the device sub-groups
        tier.add(i, start, src)

    def sums_of_squares(self) -> list[ExactSum]:
        return [s for tier in self.parts for s in tier.sums_of_squares()]

    def take(self, index: int):
        tier, i = self._tier(index)
        return tier.take(i)

    def release(self, index: int) -> None:
        tier, i = self._tier(index)
        tier.release(i)

    def zero(self) -> None:
        for tier in self.parts:
            tier.zero()

    def host_resident(self) -> list[bool]:
        return [r for tier in self.parts for r in tier.host_resident()]

    def host_flat(self) -> None:
        """None: the sums are in more than one buffer."""
        return None

    def close(self) -> None:
        first = None
        for tier in self.parts:
            try:
                tier.close()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def memory_stats(self) -> dict[str, int]:
        stats: dict[str, int] = {}
        for tier in self.parts:
            for key, value in tier.memory_stats().items():
                stats[key] = stats.get(key, 0) + value
        return stats
