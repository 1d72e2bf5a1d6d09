"""Where the optimizer's fp32 state lives: the contract, and the host-memory tier.

A `StateTier` holds, for each optimizer sub-group, the fp32 master weights and the two Adam
moments as three flat tensors. The optimizer (`infinity.zero`) never knows which tier it
talks to: it sweeps the sub-groups in order and updates each in place. The NVMe tier
implements the same contract with reads of the next sub-group and write-back of the previous
one overlapping the step of the current one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import torch

from infinity.swap.footprint import Footprint

_F32 = 4


def host_state_footprint(numels: Sequence[int]) -> Footprint:
    """`HostStateTier`'s three flat fp32 fields (master, exp_avg, exp_avg_sq)."""
    return Footprint(3 * _F32 * sum(numels))


def sweep_order(order: Sequence[int] | None, count: int) -> list[int]:
    """`order` checked to be a permutation of range(count) (None: ascending)."""
    if order is None:
        return list(range(count))
    order = [int(i) for i in order]
    if sorted(order) != list(range(count)):
        raise ValueError(
            f"a sweep order must name each of the {count} sub-groups once, got {order[:8]}"
            f"{'...' if len(order) > 8 else ''}"
        )
    return order


class SubGroupState(NamedTuple):
    """One sub-group's optimizer state: three flat fp32 tensors of the same numel."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class StateTier(Protocol):
    """The fp32 state of every sub-group, wherever it lives.

    [Note: sweep semantics] `sweep(order)` yields `(index, SubGroupState)` for every
    sub-group, in `order` (a permutation of the indices; default ascending). The tensors are
    resident in host memory and may be modified in place until the caller asks for the next
    item; every change made by then is kept (the host tier updates in place; the NVMe tier
    writes the sub-group back while the next one is stepped). A sweep may be driven from
    one thread, then another, never from two at once. Exhausting
    or closing the iterator waits for all outstanding writes and raises any I/O error, so
    after the loop the state is durable in its tier.
    """

    numels: Sequence[int]
    """Elements of each sub-group."""

    def initialize(self, index: int, master: torch.Tensor) -> None:
        """Set sub-group `index`: master weights from `master` (any float dtype, flat, numel
        of the sub-group), both moments zero."""
        ...

    def sweep(self, order: Sequence[int] | None = None) -> Iterator[tuple[int, SubGroupState]]:
        """Each sub-group's state, in `order` (see the note above)."""
        ...

    def read(self, index: int) -> SubGroupState:
        """A copy of sub-group `index`'s state in host memory (checkpointing)."""
        ...

    def write(self, index: int, state: SubGroupState) -> None:
        """Replace sub-group `index`'s state, durably once this returns (checkpoint load)."""
        ...

    def read_range(self, index: int, field: str, start: int, stop: int) -> torch.Tensor:
        """A copy of elements [start, stop) of one field ("master", "exp_avg",
        "exp_avg_sq") of sub-group `index` (checkpointing one parameter's share)."""
        ...

    def close(self) -> None:
        """Release the tier's resources (files, buffers). Idempotent."""
        ...


class HostStateTier:
    """Every sub-group's state in (unpinned) host memory: the "cpu" offload tier."""

    def __init__(self, numels: Sequence[int]) -> None:
        self.numels = list(numels)
        total = host_state_footprint(self.numels).host // (3 * _F32)
        self.flat = SubGroupState(*(torch.zeros(total, dtype=torch.float32) for _ in range(3)))
        """Each field of every sub-group back to back (sub-group i is a slice of it)."""
        self._states, start = [], 0
        for n in self.numels:
            self._states.append(SubGroupState(*(t[start : start + n] for t in self.flat)))
            start += n

    def _check(self, index: int, t: torch.Tensor, what: str) -> None:
        if not 0 <= index < len(self.numels):
            raise IndexError(f"sub-group {index} out of range (there are {len(self.numels)})")
        if t.numel() != self.numels[index]:
            raise ValueError(
                f"{what} for sub-group {index} has {t.numel()} elements, "
                f"the sub-group has {self.numels[index]}"
            )

    def initialize(self, index: int, master: torch.Tensor) -> None:
        self._check(index, master, "master")
        state = self._states[index]
        state.master.copy_(master.reshape(-1))
        state.exp_avg.zero_()
        state.exp_avg_sq.zero_()

    def sweep(self, order: Sequence[int] | None = None) -> Iterator[tuple[int, SubGroupState]]:
        for i in sweep_order(order, len(self.numels)):
            yield i, self._states[i]

    def read(self, index: int) -> SubGroupState:
        self._check(index, self._states[index].master, "state")
        return SubGroupState(*(t.clone() for t in self._states[index]))

    def write(self, index: int, state: SubGroupState) -> None:
        for name, src in zip(SubGroupState._fields, state, strict=True):
            self._check(index, src, name)
            getattr(self._states[index], name).copy_(src.reshape(-1))

    def read_range(self, index: int, field: str, start: int, stop: int) -> torch.Tensor:
        self._check(index, self._states[index].master, "state")
        return getattr(self._states[index], field)[start:stop].clone()

    def resident(self, index: int) -> SubGroupState:
        """The live tensors of sub-group `index` (host tier only: no copy)."""
        return self._states[index]

    def close(self) -> None:
        pass
