"""The parameter reads of one forward + backward: the coordinator's live-set planner
(`infinity.zero.live_plan`, the same object the engine applies) run over the order of
gathers the model's shapes give, counting its fetches instead of moving data.

Owns the order of one training iteration's gathers (`training_trace`) and the loop that
drives the planner along it as the engine's hooks do: at each gather the unit is fetched
(making room if needed) and prefetch runs ahead, then the unit ends and what is not kept is
released; the iteration's end releases every trainable parameter but the kept ones. Frozen
parameters (a LoRA base) carry over from one iteration to the next, so iterations are driven
until the steady state. Kept parameters (`zero_optimization.keep_weights_numel`: see [Note:
weights kept across micro batches] in infinity/zero/live_plan.py) carry over too, until the
optimizer step releases them: the steady iteration is a step's every micro batch but the
first, which also fetches each kept parameter once (`Replay.kept`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from infinity.config import ResolvedConfig
from infinity.estimate.shapes import ModelShape
from infinity.zero.live_plan import LivePlan, LiveTrace, kept_mask

_MAX_ITERATIONS = 6  # replayed until two in a row fetch the same (the steady state)


class Pass(enum.Enum):
    """What a gather is for."""

    FORWARD = "forward"
    RECOMPUTE = "recompute"
    """The forward of a checkpointed block, run again at the start of its backward."""
    BACKWARD = "backward"


@dataclass(frozen=True, slots=True)
class Position:
    """One gather of the trace: a module's parameters (indices into `ModelShape.params`)."""

    params: tuple[int, ...]
    kind: Pass


@dataclass(frozen=True, slots=True)
class PlannedFetch:
    """One parameter fetched from its home: decided at the gather of trace position
    `decided` (the unit's own, or one whose prefetch window reached it), needed at
    `needed`."""

    decided: int
    needed: int
    numel: int
    param: int
    """Its index in `ModelShape.params`."""


def training_trace(shape: ModelShape, *, checkpointing: bool) -> list[Position]:
    """The gathers of one training iteration, in order: forward in execution order (peft's
    adapted layer as its base layer, then lora_A, then lora_B), then backward from the last
    unit on, a decoder block recomputed first under activation checkpointing. Backward
    gathers a module only where a gradient flows out of it (`UnitShape.grad_out`, recorded
    on the meta device): a frozen embedding is not gathered in backward, nor are the frozen
    layers of the first adapted block whose input needs none."""
    trace = [Position(p, Pass.FORWARD) for u in shape.units for p in _split(shape, u.params)]
    segments: list[tuple[bool, list[tuple[int, ...]]]] = []  # (a decoder block?, modules)
    needs: dict[tuple[int, ...], bool] = {}
    last = None
    for unit in shape.units:
        parts = _split(shape, unit.params)
        for k, part in enumerate(parts):  # the adapters train; the base needs `grad_out`
            needs[part] = k > 0 or unit.grad_out
        layer = unit.block
        if layer is not None and layer == last:
            segments[-1][1].extend(parts)
        else:
            segments.append((layer is not None, parts))
        last = layer
    for block, seg in reversed(segments):
        backward = [Position(part, Pass.BACKWARD) for part in reversed(seg) if needs[part]]
        if checkpointing and block:
            # transformers' blocks: the last module's backward gather comes before the
            # recomputation, and only once (as the engine records it)
            early = backward[:1] if shape.transformers and needs[seg[-1]] else []
            trace += early + [Position(part, Pass.RECOMPUTE) for part in seg]
            backward = backward[len(early) :]
        trace += backward
    return trace


def _split(shape: ModelShape, params: Sequence[int]) -> list[tuple[int, ...]]:
    """A unit as the engine hooks it: a LoRA-adapted linear layer is three modules (the base
    layer with its weight and bias, lora_A, lora_B)."""
    names = [shape.params[i].name for i in params]
    if shape.lora_r and len(params) >= 3 and names[-2].endswith(".lora_A.weight"):
        return [tuple(params[:-2]), (params[-2],), (params[-1],)]
    return [tuple(params)]


@dataclass(frozen=True, slots=True)
class Replay:
    """The live-set policy run over one training iteration until its steady state."""

    trace: list[Position]
    fetches: list[PlannedFetch]
    """The steady iteration's fetches, in the order they are decided."""
    peak_live_numel: int
    """The most elements gathered at once over the replayed iterations (the coordinator's
    `peak_live_param_numel`)."""
    kept: tuple[int, ...]
    """The kept parameters the trace uses (indices into `ModelShape.params`): fetched once
    a step, by its first micro batch, and held on the device until the step."""


_REPLAYS: dict[tuple, tuple[ModelShape, Replay]] = {}
_REPLAYS_KEPT = 8


def param_fetches(
    shape: ModelShape, config: ResolvedConfig, *, checkpointing: bool
) -> tuple[list[Position], list[PlannedFetch]]:
    """The trace of one training iteration and the fetches of its steady state, in the
    order they are decided: iterations are replayed until two in a row fetch the same (the
    first starts with nothing gathered and, as the engine's first does, follows no trace;
    frozen parameters carry over from one to the next). The last few replays are kept: the
    placement planner asks for the same one for every candidate that differs only in what
    lives in RAM (callers must not change them)."""
    replay = replayed(shape, config, checkpointing=checkpointing)
    return replay.trace, replay.fetches


def replayed(shape: ModelShape, config: ResolvedConfig, *, checkpointing: bool) -> Replay:
    """The replay `param_fetches` reads (see there), with its peak live set."""
    zero = config.zero_optimization
    key = (id(shape), checkpointing, zero.max_live_parameters,
           zero.prefetch_bucket_size, zero.max_reuse_distance,
           zero.keep_weights_numel, tuple(shape.persistent(zero)))  # fmt: skip
    kept = _REPLAYS.get(key)
    if kept is not None and kept[0] is shape:
        return kept[1]
    result = _replay(shape, config, checkpointing)
    if len(_REPLAYS) >= _REPLAYS_KEPT:
        _REPLAYS.pop(next(iter(_REPLAYS)))
    _REPLAYS[key] = (shape, result)
    return result


def _replay(shape: ModelShape, config: ResolvedConfig, checkpointing: bool) -> Replay:
    trace = training_trace(shape, checkpointing=checkpointing)
    zero = config.zero_optimization
    plan = LivePlan(
        budget=zero.max_live_parameters,
        window=zero.prefetch_bucket_size,
        reuse=zero.max_reuse_distance,
    )
    persistent = shape.persistent(zero)
    kept = kept_of(shape, config)
    for p, keep, k in zip(shape.params, persistent, kept, strict=True):
        plan.add(p.numel, persistent=keep, frozen=not p.trainable, kept=k)
    for i, keep in enumerate(persistent):
        if keep:  # gathered since the first iteration: they count against the budget
            plan.hold(i)
    order = LiveTrace([pos.params for pos in trace], plan.numel)
    sink = _LiveSink(plan.numel)
    _iteration(plan, order, sink, traced=False)  # the engine's first: it records the trace
    previous = None
    for _ in range(_MAX_ITERATIONS):
        sink.fetches = []
        _iteration(plan, order, sink)
        if sink.fetches == previous:
            break
        previous = sink.fetches
    used = {i for pos in trace for i in pos.params}
    held = tuple(i for i, k in enumerate(kept) if k and i in used)
    return Replay(trace, sink.fetches, plan.peak_live_numel, held)


def kept_of(shape: ModelShape, config: ResolvedConfig) -> list[bool]:
    """Per parameter, whether it is kept across the micro batches of a step (`kept_mask`,
    the coordinator's rule, over the same sizes)."""
    zero = config.zero_optimization
    return kept_mask([p.numel for p in shape.params], [p.trainable for p in shape.params],
                     shape.persistent(zero), zero.keep_weights_numel)  # fmt: skip


class _LiveSink:
    """A sink that records each fetch the planner decides, and where."""

    def __init__(self, numel: Sequence[int]) -> None:
        self.numel = numel
        self.at = 0
        """The trace position of the gather running (whose prefetch decides)."""
        self.fetches: list[PlannedFetch] = []

    def fetch(self, i: int, needed: int | None) -> None:
        if needed is None:  # the untraced first iteration: its fetches are not counted
            return
        self.fetches.append(PlannedFetch(self.at, needed, self.numel[i], i))

    def release(self, i: int) -> None:
        pass


def _iteration(plan: LivePlan, order: LiveTrace, sink: _LiveSink, traced: bool = True) -> None:
    """One forward + backward as the hooks drive the coordinator: the iteration's first
    prefetch, then at each gather the unit, prefetch, and the unit's end. Untraced (the
    first iteration, which records the order): no prefetch, and no reuse known."""
    plan.begin(order if traced else None)
    sink.at = 0
    plan.prefetch((), sink)
    for pos, unit in enumerate(order.units):
        plan.advance(pos if traced else None)
        sink.at = pos
        running = set(unit)
        plan.gather(unit, sink)
        plan.prefetch(running, sink)
        for i in unit:
            plan.settle(i, pos if traced else None, sink)
    plan.release_all(sink, keep_frozen=True, keep_kept=True)
    plan.end()
