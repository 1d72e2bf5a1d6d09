"""Where the optimizer's state lives: the contract, and the host-memory tier.

A `StateTier` holds, for each optimizer sub-group, the fp32 master weights and the two Adam
moments: three flat fp32 tensors, or with the 8-bit format the moments' codes and absmax
(`infinity.swap.state_format`). The optimizer (`infinity.zero`) never knows which tier it
talks to: it sweeps the sub-groups in order and updates each in place. The NVMe tier
implements the same contract with reads of the next sub-group and write-back of the previous
one overlapping the step of the current one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from infinity.io.aio import zeroed
from infinity.swap.footprint import Footprint
from infinity.swap.state_format import StateFormat, SubGroupState, SubGroupState8

__all__ = ["HostStateTier", "StateTier", "SubGroupState", "SubGroupState8", "StateFormat"]


def host_state_footprint(numels: Sequence[int], fmt: StateFormat = StateFormat.ADAMW) -> Footprint:
    """`HostStateTier`'s fields (master and moments in `fmt`)."""
    return Footprint(sum(fmt.nbytes(n) for n in numels))


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
    format: StateFormat
    """What a sub-group's state is made of (32-bit or 8-bit moments)."""

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
        "exp_avg_sq", and with 8 bits the blocks' "exp_avg_absmax", "exp_avg_sq_absmax") of
        sub-group `index`, in that field's elements (checkpointing one parameter's share)."""
        ...

    def close(self) -> None:
        """Release the tier's resources (files, buffers). Idempotent."""
        ...


class HostStateTier:
    """Every sub-group's state in (unpinned) host memory: the "cpu" offload tier."""

    def __init__(self, numels: Sequence[int], fmt: StateFormat = StateFormat.ADAMW) -> None:
        self.numels = list(numels)
        self.format = fmt
        fields = [fmt.fields(n) for n in self.numels]
        names = [name for name, _, _ in fmt.fields(0)]
        dtypes = [dtype for _, dtype, _ in fmt.fields(0)]
        totals = [sum(f[k][2] for f in fields) for k in range(len(names))]
        # Zero pages until touched: the moments' first reads are the step's; the master is
        # written first, by `initialize` or a checkpoint's load (see `zeroed`).
        storage = {
            name: zeroed(total, dtype, written_first=name == "master")
            for name, dtype, total in zip(names, dtypes, totals, strict=True)
        }
        self.flat = fmt.state_type(**storage)
        """Each field of every sub-group back to back (sub-group i is a slice of it)."""
        self._states, starts = [], [0] * len(names)
        for f in fields:
            views = {}
            for k, (name, _, n) in enumerate(f):
                views[name] = storage[name][starts[k] : starts[k] + n]
                starts[k] += n
            state = fmt.state_type(**views)
            if fmt.eight_bit:  # the signed map's code of 0 is not a zero byte
                fmt.reset_moments(state)
            self._states.append(state)
        self._moments_zero = [True] * len(self.numels)
        """Sub-groups whose moments were never lent out or written: still zeros (for 32 bits,
        the mapping's zero pages), which `initialize` need not (and should not: it would
        fault them in) zero again."""

    def _check(self, index: int, t: torch.Tensor, what: str) -> None:
        if not 0 <= index < len(self.numels):
            raise IndexError(f"sub-group {index} out of range (there are {len(self.numels)})")
        want = getattr(self._states[index], what).numel()
        if t.numel() != want:
            raise ValueError(
                f"{what} for sub-group {index} has {t.numel()} elements, the sub-group has {want}"
            )

    def initialize(self, index: int, master: torch.Tensor) -> None:
        self._check(index, master, "master")
        state = self._states[index]
        state.master.copy_(master.reshape(-1))
        if not self._moments_zero[index]:
            self.format.reset_moments(state)

    def sweep(
        self, order: Sequence[int] | None = None
    ) -> Iterator[tuple[int, SubGroupState | SubGroupState8]]:
        for i in sweep_order(order, len(self.numels)):
            self._moments_zero[i] = False
            yield i, self._states[i]

    def read(self, index: int) -> SubGroupState | SubGroupState8:
        self._check(index, self._states[index].master, "master")
        return type(self._states[index])(*(t.clone() for t in self._states[index]))

    def write(self, index: int, state: SubGroupState | SubGroupState8) -> None:
        check_format(self.format, state)
        for name, src in zip(state._fields, state, strict=True):
            self._check(index, src, name)
            getattr(self._states[index], name).copy_(src.reshape(-1))
        self._moments_zero[index] = False

    def read_range(self, index: int, field: str, start: int, stop: int) -> torch.Tensor:
        self._check(index, self._states[index].master, "master")
        self.format.field_offset(field, 0)  # names the fields on a wrong one
        return getattr(self._states[index], field)[start:stop].clone()

    def resident(self, index: int) -> SubGroupState | SubGroupState8:
        """The live tensors of sub-group `index` (host tier only: no copy)."""
        self._moments_zero[index] = False
        return self._states[index]

    @property
    def nbytes(self) -> int:
        """Bytes of every sub-group's state."""
        return sum(t.nbytes for t in self.flat)

    def close(self) -> None:
        pass


def check_format(fmt: StateFormat, state: SubGroupState | SubGroupState8) -> None:
    """Raises unless `state` is of format `fmt` (a 32-bit state into an 8-bit tier...)."""
    if StateFormat.of(state) is not fmt:
        raise ValueError(
            f"a {StateFormat.of(state).value} state was given to a tier of {fmt.value} "
            "state; convert it first (see docs/optimizer_8bit.md)"
        )
