"""The parameter reads of one forward + backward, replayed without tensors: the
coordinator's live-set policy (infinity/zero/coordinator.py) run over the order of gathers
the model's shapes give.

Owns that replay only: gathers evict furthest-next-use first when the live budget
(persistent parameters included) is short, prefetch fetches the units within
`stage3_prefetch_bucket_size` elements that fit (evicting only what is needed later), the
end of a unit releases a trainable parameter whose next use is neither prefetched nor within
`stage3_max_reuse_distance`, and the end of an iteration releases every trainable one.
Frozen parameters (a LoRA base) are released by none of these, only evicted, so the next
forward finds the units the last backward used still gathered (see [Note: frozen
parameters stay gathered] there). Iterations are replayed until the steady state.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from infinity.config import Config
from infinity.estimate.shapes import ModelShape

_FAR = 1 << 62
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
class Fetch:
    """One parameter fetched from its home: decided at the gather of trace position
    `decided` (the unit's own, or one whose prefetch window reached it), needed at
    `needed`."""

    decided: int
    needed: int
    numel: int


def training_trace(shape: ModelShape, *, checkpointing: bool) -> list[Position]:
    """The gathers of one training iteration, in order: forward in execution order (peft's
    adapted layer as its base layer, then lora_A, then lora_B), then backward from the last
    unit on, a decoder block recomputed first under activation checkpointing. Modules
    before the first trainable parameter need no gradient, so a frozen embedding is not
    gathered in backward, nor are the frozen layers of the first adapted block whose input
    needs none (its query, key and value projections and the norm before them)."""
    trace = [Position(p, Pass.FORWARD) for u in shape.units for p in _split(shape, u.params)]
    segments: list[tuple[bool, list[tuple[int, ...]]]] = []  # (a decoder block?, modules)
    last = None
    for unit in shape.units:
        layer = unit.block
        if layer is not None and layer == last:
            segments[-1][1].extend(_split(shape, unit.params))
        else:
            segments.append((layer is not None, _split(shape, unit.params)))
        last = layer
    needs: dict[tuple[int, ...], bool] = {}
    frozen_below = True  # nothing gathered so far has a trainable parameter
    for block, seg in segments:
        trains = [any(shape.params[i].trainable for i in part) for part in seg]
        for part, t in zip(seg, trains, strict=True):
            tail = block and any(trains) and not _first_attention_input(shape, part)
            needs[part] = t or not frozen_below or tail
        frozen_below = frozen_below and not any(trains)
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


def _first_attention_input(shape: ModelShape, part: tuple[int, ...]) -> bool:
    """The norm and the q, k, v projections of a block: in the first adapted block of a
    frozen model, no gradient flows into their input."""
    name = shape.params[part[0]].name
    return any(
        k in name for k in ("input_layernorm", ".q_proj.", ".k_proj.", ".v_proj.", ".qkv_proj.")
    )


def _split(shape: ModelShape, params: Sequence[int]) -> list[tuple[int, ...]]:
    """A unit as the engine hooks it: a LoRA-adapted linear layer is three modules (the base
    layer with its weight and bias, lora_A, lora_B)."""
    names = [shape.params[i].name for i in params]
    if shape.lora_r and len(params) >= 3 and names[-2].endswith(".lora_A.weight"):
        return [tuple(params[:-2]), (params[-2],), (params[-1],)]
    return [tuple(params)]


def param_fetches(
    shape: ModelShape, config: Config, *, checkpointing: bool
) -> tuple[list[Position], list[Fetch]]:
    """The trace of one training iteration and the fetches of its steady state, in the
    order they are decided: iterations are replayed until two in a row fetch the same (the
    first starts with nothing gathered; frozen parameters carry over from one to the
    next)."""
    trace = training_trace(shape, checkpointing=checkpointing)
    replay = _Replay(shape, config, trace)
    previous = None
    for _ in range(_MAX_ITERATIONS):
        replay.iteration()
        if replay.fetches == previous:
            break
        previous = replay.fetches
    return trace, replay.fetches


def param_reads_per_micro_step(shape: ModelShape, config: Config, *, checkpointing: bool) -> int:
    """Elements fetched from their home in one forward + backward once the order is
    traced."""
    _, fetches = param_fetches(shape, config, checkpointing=checkpointing)
    return sum(f.numel for f in fetches)


class _Replay:
    """The coordinator's live set over `trace`, counting fetches instead of moving data."""

    def __init__(self, shape: ModelShape, config: Config, trace: list[Position]) -> None:
        zero = config.zero_optimization
        self.budget = int(zero.max_live_parameters)
        self.window = int(zero.prefetch_bucket_size)
        self.reuse = int(zero.max_reuse_distance)
        self.trace = [pos.params for pos in trace]
        self.numel = [p.numel for p in shape.params]
        self.frozen = [not p.trainable for p in shape.params]
        self.persistent = shape.persistent(zero)
        self.cum = [0]
        self.uses: dict[int, list[int]] = {}
        for pos, part in enumerate(self.trace):
            self.cum.append(self.cum[-1] + sum(self.numel[i] for i in part))
            for i in part:
                self.uses.setdefault(i, []).append(pos)
        self.live: dict[int, None] = {}  # non-persistent parameters gathered
        # persistent ones stay gathered and count against the budget too
        self.live_numel = sum(n for n, k in zip(self.numel, self.persistent, strict=True) if k)
        self.fetches: list[Fetch] = []

    def iteration(self) -> None:
        self.fetches = []
        upto = self._prefetch(0, 0, 0, ())
        for pos, part in enumerate(self.trace):
            want = [i for i in part if self._unfetched(i)]
            need = sum(self.numel[i] for i in want)
            if self.live_numel + need > self.budget:
                self._evict(need, pos + 1, part, None)
            for i in want:
                self._fetch(i, pos, pos)
            upto = self._prefetch(pos, pos + 1, upto, part)
            for i in part:  # the unit is done: release what is not kept
                if i in self.live and not self.frozen[i] and not self._kept(i, pos, upto):
                    self._release(i)
        for i in [i for i in self.live if not self.frozen[i]]:  # the iteration ends
            self._release(i)

    def _unfetched(self, i: int) -> bool:
        return not self.persistent[i] and i not in self.live

    def _kept(self, i: int, pos: int, upto: int) -> bool:
        nxt = self._next_use(i, pos)
        return nxt != _FAR and (nxt < upto or self.cum[nxt] - self.cum[pos + 1] <= self.reuse)

    def _next_use(self, i: int, after: int) -> int:
        return next((p for p in self.uses.get(i, ()) if p > after), _FAR)

    def _fetch(self, i: int, decided: int, needed: int) -> None:
        self.live[i] = None
        self.live_numel += self.numel[i]
        self.fetches.append(Fetch(decided, needed, self.numel[i]))

    def _release(self, i: int) -> None:
        del self.live[i]
        self.live_numel -= self.numel[i]

    def _evict(self, need: int, cursor: int, running: tuple[int, ...], before: int | None) -> None:
        """Furthest next use first; with `before`, only what is needed after it."""
        victims = [(self._next_use(i, cursor - 1), i) for i in self.live if i not in running]
        # ties (a weight and its bias) in the order they were gathered, as the engine's
        # stable sort leaves them
        victims.sort(key=lambda v: v[0], reverse=True)
        for nxt, i in victims:
            if self.live_numel + need <= self.budget or (before is not None and nxt <= before):
                break
            self._release(i)

    def _prefetch(self, at: int, cursor: int, upto: int, running: tuple[int, ...]) -> int:
        """The units within the window from `cursor` that fit; returns where it stopped."""
        p = max(upto, cursor)
        while p < len(self.trace) and self.cum[p] - self.cum[cursor] < self.window:
            want = [i for i in self.trace[p] if self._unfetched(i)]
            need = sum(self.numel[i] for i in want)
            if self.live_numel + need > self.budget:
                self._evict(need, cursor, running, p)
                if self.live_numel + need > self.budget:
                    break
            for i in want:
                self._fetch(i, at, p)
            p += 1
        return p
