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

import re
from collections.abc import Sequence

from infinity.config import Config
from infinity.estimate.shapes import ModelShape

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FAR = 1 << 62
_STEPS = 3  # iterations replayed: the last is the steady state


def training_trace(shape: ModelShape, *, checkpointing: bool) -> list[tuple[int, ...]]:
    """Parameter indices of each gather of one training iteration, in order: forward in
    execution order (peft's adapted layer as its base layer, then lora_A, then lora_B),
    then backward from the last unit on, a decoder block recomputed first under activation
    checkpointing. A frozen embedding is not gathered in backward (nothing before it needs
    a gradient), nor are the frozen weights of the first block's layers whose input needs
    none (the query, key and value projections and the norm before them)."""
    forward = [part for unit in shape.units for part in _split(shape, unit.params)]
    trace = list(forward)
    segments: list[list[tuple[int, ...]]] = []
    last = None
    for unit in shape.units:
        m = _LAYER.search(unit.name)
        layer = m.group(1) if m else None
        parts = _split(shape, unit.params)
        if layer is not None and layer == last:
            segments[-1].extend(parts)
        else:
            segments.append(list(parts))
        last = layer
    frozen_below = True  # nothing before this point needs a gradient
    needs: dict[tuple[int, ...], bool] = {}
    for seg in segments:
        for part in seg:
            trainable = any(shape.params[i].trainable for i in part)
            needs[part] = trainable or not frozen_below
        if any(shape.params[i].trainable for part in seg for i in part):
            frozen_below = False
    for seg in reversed(segments):
        if checkpointing and len(seg) > 1:
            trace += seg
        trace += [part for part in reversed(seg) if needs[part] or _first_block_tail(shape, part)]
    return trace


def _first_block_tail(shape: ModelShape, part: tuple[int, ...]) -> bool:
    """Layers of a frozen first block after its attention: their gradient flows on to the
    adapters of the attention (o_proj's input is the attention output, which depends on
    trainable q, k, v adapters)."""
    name = shape.params[part[0]].name
    return (
        ".self_attn.q_proj" not in name
        and ".self_attn.k_proj" not in name
        and (".self_attn.v_proj" not in name and "input_layernorm" not in name)
    )


def _split(shape: ModelShape, params: Sequence[int]) -> list[tuple[int, ...]]:
    """A unit as the engine hooks it: a LoRA-adapted linear layer is three modules."""
    if shape.lora_r and len(params) == 3 and shape.params[params[1]].name.endswith("lora_A.weight"):
        return [(params[0],), (params[1],), (params[2],)]
    return [tuple(params)]


def param_reads_per_micro_step(
    shape: ModelShape, config: Config, *, checkpointing: bool, persistent: Sequence[bool]
) -> int:
    """Elements fetched from their home in one forward + backward once the order is traced:
    the coordinator's policy replayed over `_STEPS` iterations, the last one counted."""
    zero = config.zero_optimization
    budget = int(zero.max_live_parameters)
    window = int(zero.prefetch_bucket_size)
    reuse = int(zero.max_reuse_distance)
    trace = training_trace(shape, checkpointing=checkpointing)
    numel = [p.numel for p in shape.params]
    frozen = [not p.trainable for p in shape.params]
    cum = [0]
    uses: dict[int, list[int]] = {}
    for pos, part in enumerate(trace):
        cum.append(cum[-1] + sum(numel[i] for i in part))
        for i in part:
            uses.setdefault(i, []).append(pos)

    def next_use(i: int, after: int) -> int:
        return next((p for p in uses.get(i, ()) if p > after), _FAR)

    live: dict[int, None] = {}  # non-persistent parameters gathered
    # persistent ones stay gathered and count against the budget too
    state = {"live": sum(n for n, keep in zip(numel, persistent, strict=True) if keep), "reads": 0}

    def fetch(i: int) -> None:
        live[i] = None
        state["live"] += numel[i]
        state["reads"] += numel[i]

    def release(i: int) -> None:
        del live[i]
        state["live"] -= numel[i]

    def evict(need: int, here: int, keep: tuple[int, ...], used_before: int | None) -> None:
        victims = sorted(((next_use(i, here - 1), i) for i in live if i not in keep), reverse=True)
        for nxt, i in victims:
            if state["live"] + need <= budget or (used_before is not None and nxt <= used_before):
                break
            release(i)

    def prefetch(cursor: int, upto: int, running: tuple[int, ...]) -> int:
        p = max(upto, cursor)
        while p < len(trace) and cum[p] - cum[cursor] < window:
            want = [i for i in trace[p] if not persistent[i] and i not in live]
            need = sum(numel[i] for i in want)
            if state["live"] + need > budget:
                evict(need, cursor, running, p)
                if state["live"] + need > budget:
                    break
            for i in want:
                fetch(i)
            p += 1
        return p

    counted = 0
    for _ in range(_STEPS):
        state["reads"] = 0
        upto = prefetch(0, 0, ())
        for pos, part in enumerate(trace):
            cursor = pos + 1
            need = sum(numel[i] for i in part if not persistent[i] and i not in live)
            if state["live"] + need > budget:
                evict(need, cursor, part, None)
            for i in part:
                if not persistent[i] and i not in live:
                    fetch(i)
            upto = prefetch(cursor, upto, part)
            for i in part:  # done: release what is not kept
                if i in live and not frozen[i]:
                    nxt = next_use(i, pos)
                    if nxt == _FAR or (nxt >= upto and cum[nxt] - cum[pos + 1] > reuse):
                        release(i)
        for i in [i for i in live if not frozen[i]]:  # the iteration ends
            release(i)
        counted = state["reads"]
    return counted
