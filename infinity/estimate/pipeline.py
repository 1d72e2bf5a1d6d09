"""One micro step on the CPU device with parameters on NVMe, as a pipeline of the model's
gathers: the disk reads parameters ahead of the cores as far as the coordinator's prefetch
and the staging pool let it, and the cores wait where a read has not landed.

Owns the replay of a micro step's gathers against the disk (`micro_step_s`). What is read,
where each read is decided and where it is needed come from the coordinator's policy
replayed in `infinity.estimate.param_traffic`; the CPU work from the rates. See [Note: the
step model] in result.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from infinity.config import Config
from infinity.estimate.param_traffic import Pass, PlannedFetch, param_fetches
from infinity.estimate.shapes import ModelShape
from infinity.estimate.sizing import home_on_nvme


@dataclass(frozen=True, slots=True)
class Gather:
    """One position of the trace, as the cores see it."""

    flops: float
    """Its share of the compute, in weight elements of its matmuls times passes (a
    backward of trainable weights counts two, of frozen ones one)."""
    copied_numel: int
    """Elements copied at it on the CPU device: the parameters fetched for it, and in
    backward the trainable weights' gradients."""


@dataclass(frozen=True, slots=True)
class Prefetch:
    """A micro step's gathers and its NVMe reads (in the order decided), and the
    `offload_param.buffer_count` staging buffers the reads pass through."""

    order: tuple[Gather, ...]
    reads: tuple[PlannedFetch, ...]
    buffers: int


def prefetch_of(shape: ModelShape, config: Config, *, checkpointing: bool) -> Prefetch:
    """The gathers of one forward + backward and their fetches (see `param_fetches`)."""
    trace, fetches = param_fetches(shape, config, checkpointing=checkpointing)
    # A frozen home kept in RAM (`max_in_cpu`) is neither read nor copied: gathers alias it.
    on_nvme = home_on_nvme(shape, config.zero_optimization)
    fetches = [f for f in fetches if on_nvme[f.param]]
    matmul = {f"{lin.name}.weight" for lin in shape.linears}
    fetched = [0] * len(trace)
    for f in fetches:
        fetched[f.needed] += f.numel
    order = []
    for pos, position in enumerate(trace):
        params = [shape.params[i] for i in position.params]
        backward = position.kind is Pass.BACKWARD
        # Matmuls dominate; the embedding's lookup and the norms cost next to nothing.
        weights = [p for p in params if p.name in matmul or ".lora_" in p.name]
        trainable = sum(p.numel for p in params if p.trainable)
        flops = sum(p.numel * (2 if backward and p.trainable else 1) for p in weights)
        order.append(Gather(float(flops), fetched[pos] + (trainable if backward else 0)))
    buffers = config.zero_optimization.offload_param.buffer_count
    return Prefetch(tuple(order), tuple(fetches), buffers)


def micro_step_s(
    pre: Prefetch,
    *,
    cpu_s: tuple[float, float, float],
    read_bps: float,
    itemsize: int,
    disk_busy_s: float = 0.0,
) -> float:
    """Forward + backward of one micro step: the cores run each gather's share of
    `cpu_s` = (compute, copies, hooks) in trace order and wait for the reads it needs; the
    disk reads one after another in the order decided, each once the cores reach the
    gather that decided it and a staging buffer is free (a buffer comes back at the first
    gather after its read landed, which copies it to the device). The disk starts
    `disk_busy_s` in with other reads queued before the first (the optimizer state the
    last sweep read ahead)."""
    order = pre.order
    compute, copies, hooks = cpu_s
    flops = sum(g.flops for g in order) or 1.0
    copied = sum(g.copied_numel for g in order) or 1
    work = [
        compute * g.flops / flops + copies * g.copied_numel / copied + hooks / len(order)
        for g in order
    ]
    reads = list(pre.reads)
    needed: dict[int, list[int]] = {}
    for k, f in enumerate(reads):
        needed.setdefault(f.needed, []).append(k)
    landed: dict[int, float] = {}  # read index -> when it lands
    pool: deque[tuple[int, float]] = deque()  # reads holding a staging buffer
    nxt, disk, t = 0, disk_busy_s, 0.0

    def issue(at: float) -> None:
        nonlocal nxt, disk
        disk = max(disk, at) + reads[nxt].numel * itemsize / read_bps
        landed[nxt] = disk
        pool.append((nxt, disk))
        nxt += 1

    for pos in range(len(order)):
        pool = deque(e for e in pool if e[1] > t)  # landed: copied, the buffer is back
        while nxt < len(reads) and reads[nxt].decided <= pos and len(pool) < pre.buffers:
            issue(t)
        needs = needed.get(pos, [])
        for k in needs:
            while k not in landed:  # needed now: the oldest reads land first
                t = max(t, pool.popleft()[1])
                issue(t)
            t = max(t, landed[k])
        pool = deque(e for e in pool if e[0] not in needs)
        t += work[pos]
    return t
