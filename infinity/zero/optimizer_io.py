"""The partitioned optimizer's state in and out: the first weights and masters from the
slots' build partitions, one slot's share of a field read from the state tier, and every
slot's state written to it from a checkpoint's tensors.
The optimizer (`infinity.zero.optimizer`) owns the state; these only move it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from infinity.swap.state_tier import SubGroupState
from infinity.zero.build_files import release_build_pages

STATE_FIELDS = SubGroupState._fields


@torch.no_grad()  # a partition may be a leaf that requires grad; the buffers never do
def load_initial(opt: Any, slots: Sequence[Any]) -> None:
    """Weights and masters from the slots' partitions, one sub-group at a time."""
    layout = opt.layout
    for g in range(layout.num_sub_groups):
        start, stop = layout.range(g)
        out = opt.weights.out(start, stop)
        pieces = layout.pieces(g)
        done = 0  # out[:done] is written: the pieces cover it, the padding between is zero
        for slot, a, b in pieces:
            at = layout.offsets[slot] + a - start
            if not opt.aliased:
                out[done:at].zero_()
            out[at : at + b - a].copy_(slots[slot].partition[a:b])
            done = at + b - a
        if not opt.aliased:
            out[done:].zero_()
        release_build_pages(slots[slot].partition for slot, _, _ in pieces)
        if not opt.aliased:
            opt.store.initialize(g, out)
        opt.weights.commit(start, out)
    opt.weights.finish()


def read_slot(opt: Any, slot: int, field: str) -> torch.Tensor:
    """Slot `slot`'s share of one field of the state, read sub-group by sub-group."""
    lo, hi = opt._span(slot)
    out = torch.empty(hi - lo, dtype=torch.float32)
    for g in opt.layout.sub_groups_of(slot):
        start, stop = opt.layout.range(g)
        a, b = max(lo, start), min(hi, stop)
        out[a - lo : b - lo] = opt.store.read_range(g, field, a - start, b - start)
    return out


@torch.no_grad()
def load_state_tensors(opt: Any, get: Callable[[str], torch.Tensor]) -> None:
    """Every slot's state from `get(name)` (names as in `state_tensors`), written to the
    store one sub-group at a time; the weights become the loaded masters."""
    layout = opt.layout
    try:
        for g in range(layout.num_sub_groups):
            start, stop = layout.range(g)
            state = SubGroupState(
                *(torch.zeros(stop - start, dtype=torch.float32) for _ in STATE_FIELDS)
            )
            for slot, a, b in layout.pieces(g):
                at = layout.offsets[slot] + a - start
                for field in STATE_FIELDS:
                    src = _get_state(opt, get, slot, field)
                    getattr(state, field)[at : at + b - a].copy_(src[a:b])
            opt.store.write(g, state)
            if not opt.aliased:
                out = opt.weights.out(start, stop)
                out.copy_(state.master)
                opt.weights.commit(start, out)
    finally:
        opt.weights.finish()


def _get_state(opt: Any, get: Callable[[str], torch.Tensor], slot: int, field: str):
    name = f"{opt._names[slot]}.{field}"
    try:
        t = get(name)
    except KeyError:
        raise ValueError(
            f"no optimizer state {name!r} (slot {slot}) to load; the checkpoint was saved "
            "from another model or without optimizer state"
        ) from None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"optimizer state {name!r} must be a float tensor, got {t!r:.80}")
    if t.numel() != opt._numels[slot]:
        raise ValueError(
            f"optimizer state {name!r} has {t.numel()} elements but slot {slot} has "
            f"{opt._numels[slot]}; the checkpoint is from a different model or partitioning"
        )
    return t.reshape(-1)
