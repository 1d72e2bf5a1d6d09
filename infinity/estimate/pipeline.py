"""One micro step on the CPU device with parameters on NVMe, as a pipeline of the model's
gathers: the disk reads parameters ahead of the cores as far as the prefetch window and the
staging pool let it, and the cores wait where a read has not landed.

Owns the order of gathers one forward + backward makes (`gather_order`, built from the
model's shapes) and the replay of that order against the disk (`micro_step_s`); the bytes
read come from `infinity.estimate.sizing` and the CPU work from the rates, so this decides
only *when* the bytes move. See [Note: the step model] in result.py.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

from infinity.config import Config
from infinity.estimate.shapes import ModelShape, UnitShape
from infinity.estimate.sizing import Sizes

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class Gather:
    """One position of the trace: a unit gathered for a forward, a recomputation or a
    backward."""

    numel: int
    """Elements of the unit (its distance along the trace, as the prefetch window counts)."""
    read_numel: int
    """Elements read from NVMe for it here (0: still gathered, or persistent)."""
    flops: float
    """Its share of the compute, in weight elements times passes (a backward of trainable
    weights counts two, of frozen ones one)."""
    copied_numel: int
    """Elements copied at it on the CPU device: the gathered ones, and in backward the
    trainable weights' gradients."""


@dataclass(frozen=True, slots=True)
class Prefetch:
    """What bounds how far reads run ahead of compute: `stage3_prefetch_bucket_size`
    elements along the trace and `offload_param.buffer_count` staging buffers."""

    order: tuple[Gather, ...]
    window_numel: int
    buffers: int


def prefetch_of(shape: ModelShape, config: Config, sz: Sizes, *, checkpointing: bool) -> Prefetch:
    zero = config.zero_optimization
    order = gather_order(shape, config, sz, checkpointing=checkpointing)
    return Prefetch(tuple(order), int(zero.prefetch_bucket_size), zero.offload_param.buffer_count)


def gather_order(
    shape: ModelShape, config: Config, sz: Sizes, *, checkpointing: bool
) -> list[Gather]:
    """The units in the order one forward + backward gathers them: forward in execution
    order; backward from the last unit on, each decoder block recomputed first (in forward
    order) under activation checkpointing and its units then needed again, in reverse,
    while still gathered. Forward and each recomputation read every non-persistent unit
    (a backward without recomputation reads it for the backward); the first units of the
    backward, still gathered at the turn (`retained_numel`), read nothing. The reads are
    scaled to the estimate's `param_read_bytes_per_micro_step`, so only their timing is
    modelled here."""
    persistent = shape.persistent(config.zero_optimization)
    raw: list[tuple[UnitShape, str]] = [(u, "forward") for u in shape.units]
    for segment in reversed(_segments(shape.units)):
        if checkpointing and len(segment) > 1:
            raw += [(u, "recompute") for u in segment]
            raw += [(u, "backward-held") for u in reversed(segment)]
        else:
            raw += [(u, "backward") for u in reversed(segment)]
    kept = retained_numel(shape, config)
    linear = {lin.name for lin in shape.linears}
    order, turn = [], len(shape.units)
    for k, (unit, kind) in enumerate(raw):
        params = [shape.params[i] for i in unit.params]
        numel = sum(p.numel for p in params)
        read = shape.unit_numel(unit, persistent=persistent)
        if kind == "backward-held":
            read = 0
        elif k >= turn and kept > 0 and read:  # still gathered when backward begins
            kept -= read
            read = 0
        trainable = sum(p.numel for p in params if p.trainable)
        backward = kind.startswith("backward")
        # Matmuls dominate: a linear unit's work follows its weights (the embedding's
        # lookup costs next to nothing); a backward is one pass more for trainable ones.
        flops = float(numel + (trainable if backward else 0)) if unit.name in linear else 0.0
        order.append(Gather(numel, read, flops, read + (trainable if backward else 0)))
    return _scaled(order, sz.param_read_bytes_per_micro_step // max(1, sz.itemsize))


def _segments(units: tuple[UnitShape, ...]) -> list[list[UnitShape]]:
    """Consecutive units of one decoder block together; every other unit alone."""
    out: list[list[UnitShape]] = []
    last = None
    for unit in units:
        m = _LAYER.search(unit.name)
        layer = m.group(1) if m else None
        if layer is not None and layer == last:
            out[-1].append(unit)
        else:
            out.append([unit])
        last = layer
    return out


def _scaled(order: list[Gather], total_read: int) -> list[Gather]:
    have = sum(g.read_numel for g in order)
    if not have:
        return order
    f = total_read / have
    return [Gather(g.numel, round(g.read_numel * f), g.flops, g.copied_numel) for g in order]


def micro_step_s(
    pre: Prefetch, *, cpu_s: tuple[float, float, float], read_bps: float, itemsize: int
) -> float:
    """Forward + backward of one micro step: the cores run each gather's share of
    `cpu_s` = (compute, copies, hooks) in trace order and wait for its read where it has not
    landed; the disk reads in trace order, one after another, each issued once the cores
    reach the gather whose prefetch window covers it (or need it) and a staging buffer is
    free (a buffer comes back at the first gather after its read landed, which copies it
    to the device)."""
    order = pre.order
    compute, copies, hooks = cpu_s
    flops = sum(g.flops for g in order) or 1.0
    copied = sum(g.copied_numel for g in order) or 1
    work = [
        compute * g.flops / flops + copies * g.copied_numel / copied + hooks / len(order)
        for g in order
    ]
    reads = [p for p, g in enumerate(order) if g.read_numel]
    cum = [0]
    for g in order:
        cum.append(cum[-1] + g.numel)
    done: dict[int, float] = {}
    pool: deque[tuple[int, float]] = deque()  # reads holding a staging buffer
    nxt, disk, t = 0, 0.0, 0.0

    def issue(at: float) -> None:
        nonlocal nxt, disk
        p = reads[nxt]
        disk = max(disk, at) + order[p].read_numel * itemsize / read_bps
        done[p] = disk
        pool.append((p, disk))
        nxt += 1

    for pos in range(len(order)):
        pool = deque(e for e in pool if e[1] > t)  # landed: copied, the buffer is back
        while nxt < len(reads) and len(pool) < pre.buffers:
            p = reads[nxt]
            if p != pos and cum[p] - cum[pos + 1] >= pre.window_numel:
                break  # outside the prefetch window of this gather
            issue(t)
        if order[pos].read_numel:
            while pos not in done:  # needed now: the oldest reads land first
                t = max(t, pool.popleft()[1])
                issue(t)
            t = max(t, done[pos])
            pool = deque(e for e in pool if e[0] != pos)
        t += work[pos]
    return t


def retained_numel(shape: ModelShape, config: Config) -> int:
    """Non-persistent elements still gathered when forward turns into backward: the last
    units of the forward, as many as the live budget (and the reuse distance) hold. Backward
    finds them gathered; the rest it gathers again."""
    zero = config.zero_optimization
    persistent = shape.persistent(zero)
    room = min(int(zero.max_live_parameters), int(zero.max_reuse_distance))
    kept = 0
    for unit in reversed(shape.units):
        n = shape.unit_numel(unit, persistent=persistent)
        if kept and kept + n > room:  # the last unit stays whatever the budget
            break
        kept += n
    return kept
