"""Where the optimizer writes the trainable weights it produces, and their homes.

The partitioned optimizer produces, for each sub-group (a range of its flat space, see
[Note: the flat space] in sub_groups.py), new weights in the model dtype. The weight output
says where they go: `HostWeights` keeps every slot's weights in one flat host buffer that the
step writes in place; `NvmeWeights` keeps none in memory: each sub-group's weights are
written into a small ring of staging buffers and from there to the parameter tier's flat
extent on NVMe, while the next sub-group is stepped. Either is built before the optimizer
(`make_weights`) and gives each trainable parameter its home (`home(slot)`: a range of the
same flat buffer or extent), so the records and the optimizer share one copy. It owns those
buffers, not the decision of what to write (the optimizer's) nor the files (the parameter
tier's): the disk's flat extent is laid out by an explicit call (`lay_out_flat`) before
`NvmeWeights` is made over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from infinity.accelerator import Accelerator
from infinity.io.aio import aligned_empty, zeroed
from infinity.swap.footprint import Footprint
from infinity.swap.state_tier import HostStateTier
from infinity.swap.store import reserved_nbytes
from infinity.zero.home import HostHome, NvmeHome
from infinity.zero.sub_groups import FlatLayout

_RING = 2
"""Staging buffers of NvmeWeights: one filled by the step while the other is written."""


def staging_numel(layout: FlatLayout) -> int:
    """Elements of each of NvmeWeights' staging buffers: one sub-group."""
    return max(min(layout.sub_group_size, layout.total), 1)


def staging_host_bytes(layout: FlatLayout, dtype: torch.dtype) -> int:
    """Host bytes of NvmeWeights' ring of staging buffers."""
    return _RING * staging_numel(layout) * dtype.itemsize


def aliases_state(dtype: torch.dtype, *, state_on_host: bool) -> bool:
    """The alias rule: with an fp32 model and the optimizer state in host memory, the
    weights are the fp32 masters themselves (see [Note: where the weights live] in
    optimizer.py)."""
    return dtype == torch.float32 and state_on_host


def weights_footprint(
    layout: FlatLayout, dtype: torch.dtype, *, nvme: bool, state_on_host: bool
) -> Footprint:
    """The weight output over `layout`: `NvmeWeights`' staging ring and the parameter
    tier's flat extent, or `HostWeights`' flat buffer (none of its own when it aliases the
    masters)."""
    if nvme:
        disk = reserved_nbytes(layout.total * dtype.itemsize)
        return Footprint(staging_host_bytes(layout, dtype), disk)
    if aliases_state(dtype, state_on_host=state_on_host):
        return Footprint(0)
    return Footprint(layout.total * dtype.itemsize)


class HostWeights:
    """Every slot's weights in one flat host tensor (padding included) that the step writes
    in place."""

    def __init__(self, flat: torch.Tensor, layout: FlatLayout, names: Sequence[str]) -> None:
        self.flat = flat
        self.layout = layout
        self.names = tuple(names)

    def home(self, slot: int) -> HostHome:
        """Slot `slot`'s home: its range of the flat buffer."""
        start = self.layout.offsets[slot]
        return HostHome(self.flat[start : start + self.layout.numels[slot]], name=self.names[slot])

    def view(self, start: int, stop: int) -> torch.Tensor:
        """The weights of flat elements [start, stop) (the slots' homes are such views)."""
        return self.flat[start:stop]

    def out(self, start: int, stop: int) -> torch.Tensor:
        """Where the step puts the new weights of the sub-group [start, stop)."""
        return self.flat[start:stop]

    def commit(self, start: int, out: torch.Tensor) -> None:
        """The weights in `out` are final (nothing to do: they are in place)."""

    def finish(self) -> None:
        """Every committed sub-group is in its home (nothing outstanding on the host)."""

    @property
    def host_bytes(self) -> int:
        return self.flat.nbytes

    @property
    def pinned_bytes(self) -> int:
        return self.flat.nbytes if self.flat.is_pinned() else 0


def lay_out_flat(store: Any, layout: FlatLayout, names: Sequence[str], dtype: torch.dtype) -> None:
    """Lay out `layout`'s flat space in the parameter tier `store` as one extent, each
    slot `names[i]` at its offset (`NvmeParamTier.reserve_flat`): once, before
    `NvmeWeights` is made over it."""
    spans = zip(names, layout.offsets, layout.numels, strict=True)
    store.reserve_flat({name: (off, n) for name, off, n in spans}, layout.total, dtype)


class NvmeWeights:
    """The slots' weights on NVMe in the parameter tier's flat extent (laid out before by
    `lay_out_flat`), written one sub-group at a time through a ring of staging buffers."""

    def __init__(
        self,
        param_tier: Any,
        layout: FlatLayout,
        names: Sequence[str],
        dtype: torch.dtype,
    ) -> None:
        flat = param_tier.flat
        if flat is None or flat.total != layout.total or flat.dtype != dtype:
            raise ValueError(
                f"NvmeWeights: the parameter tier's flat extent is {flat} but these weights "
                f"need {layout.total} elements of {dtype}; lay it out first with "
                "lay_out_flat(store, layout, names, dtype)"
            )
        self.param_tier = param_tier
        self.layout = layout
        self.names = tuple(names)
        self._ring = [aligned_empty(staging_numel(layout), dtype) for _ in range(_RING)]
        self._pending: list[Any] = [None] * _RING
        self._next = 0

    def home(self, slot: int) -> NvmeHome:
        """Slot `slot`'s home: its range of the flat extent."""
        return NvmeHome(self.param_tier, self.names[slot])

    def view(self, start: int, stop: int) -> torch.Tensor:
        raise RuntimeError(
            "the trainable weights live on NVMe (offload_param.device 'nvme'): there is no host "
            "buffer to view; read a parameter with its record's home.read()"
        )

    def out(self, start: int, stop: int) -> torch.Tensor:
        """A staging buffer for the new weights of [start, stop), once its last write landed."""
        k = self._next
        self._wait(k)
        return self._ring[k][: stop - start]

    def commit(self, start: int, out: torch.Tensor) -> None:
        """Start writing `out` (from `out()`) to flat element `start` of the home."""
        k = self._next
        assert out.data_ptr() == self._ring[k].data_ptr(), "commit the buffer out() returned"
        self._pending[k] = self.param_tier.write_flat(start, out)
        self._next = (k + 1) % _RING

    def finish(self) -> None:
        """Wait for every write; raise the first failure after all have finished."""
        first: BaseException | None = None
        for k in range(_RING):
            try:
                self._wait(k)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _wait(self, k: int) -> None:
        fut, self._pending[k] = self._pending[k], None
        if fut is not None:
            fut.wait()

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self._ring)

    pinned_bytes = 0  # the ring is written to disk, never copied to a device


def make_weights(
    layout: FlatLayout,
    names: Sequence[str],
    dtype: torch.dtype,
    *,
    state_tier: Any,
    param_tier: Any = None,
    pin: Accelerator | None = None,
) -> HostWeights | NvmeWeights:
    """The weight output of an optimizer over `layout` with `state_tier`: on NVMe in
    `param_tier` when given (its flat extent laid out by `lay_out_flat`); else the fp32
    masters themselves when they are in host memory (see [Note: where the weights live] in
    optimizer.py); else a new flat host buffer, pinned by `pin` where it can pin (the homes
    every gather copies to the device from: pageable memory copies at a fraction of the
    bus's rate and blocks the host while it does)."""
    if param_tier is not None:
        return NvmeWeights(param_tier, layout, names, dtype)
    on_host = isinstance(state_tier, HostStateTier)
    if aliases_state(dtype, state_on_host=on_host):
        return HostWeights(state_tier.flat.master, layout, names)
    numel = weights_footprint(layout, dtype, nvme=False, state_on_host=on_host).host
    numel //= dtype.itemsize
    if pin is not None and pin.pin_supported():
        flat = pin.empty_pinned((numel,), dtype).zero_()
    else:
        flat = zeroed(numel, dtype, written_first=True)  # the optimizer's first copy
    return HostWeights(flat, layout, names)


def aliases_masters(weights: HostWeights | NvmeWeights, state_tier: Any) -> bool:
    """Whether `weights` are the fp32 masters of `state_tier` (stepped in place)."""
    return (
        isinstance(weights, HostWeights)
        and isinstance(state_tier, HostStateTier)
        and weights.flat.data_ptr() == state_tier.flat.master.data_ptr()
    )
