"""The partitioned optimizer's first state (weights and masters from the slots' build
partitions; a checkpoint's state goes through `infinity.zero.optimizer_state`) and the
host bytes it holds, and master weights set from outside a step.
The optimizer (`infinity.zero.optimizer`) owns the state; this only moves it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from infinity.swap.state_tier import HostStateTier
from infinity.utils.exact_sum import ExactSum
from infinity.zero.build_files import release_build_pages


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
            opt.state_tier.initialize(g, out)
        opt.weights.commit(start, out)
    opt.weights.finish()


def memory_stats(opt: Any) -> dict[str, int]:
    """Host bytes the optimizer `opt` holds: fp32 grads, weights (0 when they alias the
    masters; the staging ring with the NVMe weight home) and state: all of it with the
    host tier; with another tier, its host buffers ("optim_host_buffer_bytes" of the
    tier's own `memory_stats()`, whose entries are merged in)."""
    grad_stats = dict(opt.grads.memory_stats())
    grad = grad_stats.pop("grad_host_bytes")
    part = 0 if opt.aliased else opt.weights.host_bytes
    tier_stats = {}
    if isinstance(opt.state_tier, HostStateTier):
        state = opt.state_tier.nbytes
    else:
        if callable(getattr(opt.state_tier, "memory_stats", None)):
            tier_stats = dict(opt.state_tier.memory_stats())
        # The NVMe pipeline's buffers, and the sub-groups a split keeps in RAM.
        state = int(tier_stats.get("optim_host_buffer_bytes", 0))
        state += int(tier_stats.pop("optim_host_state_bytes", 0))
    return {
        **tier_stats,
        **grad_stats,
        "numel": sum(opt._numels),
        "optim_state_bits": 8 if opt.format.eight_bit else 32,
        "grad_bytes": grad,
        "weights_bytes": part,
        "state_bytes": state,
        "host_bytes": grad + part + state + opt.ahead_copies.nbytes,
        "optim_overlap_bytes": opt.ahead_copies.nbytes,
        "optim_overlap_peak_bytes": opt.overlap_peak_bytes,
    }


def write_masters(opt: Any, i: int, values: torch.Tensor) -> None:
    """Slot i's fp32 master weights := `values` (its numel), moments kept, in whichever
    tier holds the state (the caller writes the slot's 16-bit home, which the model reads:
    with fp32 weights aliasing the masters, this writes both)."""
    lo, hi = opt.slot_span(i)
    if values.numel() != hi - lo:
        raise ValueError(f"set_masters: slot {i} has {hi - lo} elements, got {values.numel()}")
    for g in opt.layout.sub_groups_of(i):
        start, stop = opt.layout.range(g)
        a, b = max(lo, start), min(hi, stop)
        state = opt.state_tier.read(g)
        state.master[a - start : b - start].copy_(values[a - lo : b - lo])
        opt.state_tier.write(g, state)


def scaled_norm(grads: Any, comm: Any) -> float:
    """The global L2 norm of the (loss-scaled) gradient sums over every rank."""
    # Exact sums, so the same bits whatever the tier, the sub-groups or the ranks (see
    # [Note: the norm's order] in infinity/swap/grad_tier.py); inf/NaN propagate.
    total = ExactSum()
    for s in grads.sums_of_squares():
        total += s
    if comm.world_size > 1:  # the shards' padding is zero: it adds nothing
        total = ExactSum(comm.all_reduce_(total.bins))  # a sum of integers below 2^53: exact
    return math.sqrt(total.value())
