"""The overlapped optimizer step: sub-groups stepped during the last micro batch's backward.

Owns one step's speculation: which sub-groups' gradients are final, the worker thread that
steps them through the state tier's sweep, their state from before the step, and settling
them once the step knows the global norm (confirm, redo or restore). It does not own the
Adam pass, the weights or the gradients: the optimizer hands it callables for those.

[Note: the overlapped step] What runs beside what. The last micro batch's forward starts a
worker thread on a sweep of the state tier in descending sub-group order, the order backward
finishes them in (slots are laid out in parameter order, backward runs from the last layer
to the first). The sweep reads each sub-group's state (NVMe reads run ahead of it, as in any
sweep; those of the first ones were issued when the previous step's sweep ended) while
backward runs, since no read depends on a gradient. A sub-group is final when every slot
with elements in it has had its gradient added in this backward (`added`); the worker then
copies its state (`before`) and runs the same Adam pass the serial step runs, with
grad_scale = 1 / loss_scale, i.e. assuming the clip coefficient is 1 and nothing overflowed;
the new weights go to a scratch buffer, nothing reaches the homes, the gathered copies or
the gradient sums. It stops at the first sub-group that cannot be stepped early (gradient
sums off the host, or past `overlap_numel` elements) and when the step begins.

Why the bits cannot change. The serial step computes clip = min(1, max_norm / (norm +
1e-6)) (1.0 when clipping is off) and passes grad_scale = clip / loss_scale to the kernel. A
speculated sub-group is confirmed only when the step finds no overflow, clip == 1.0 exactly
(then clip / loss_scale is the same float as 1 / loss_scale), and the same lr, loss scale
and step count as the speculation assumed, and when no slot of it received a gradient after
it was final (`spoiled`). Then its kernel saw the same inputs as the serial kernel would
(same state, same gradient sums, same constants, same element offsets in the same runs, so
the same SIMD/scalar split) and its outputs are those bits; confirming only publishes the
new weights and releases the gradients, as the serial step does after its kernel. Anything
else is undone exactly: each speculated sub-group is stepped again from its `before` copy
(a bitwise copy, so the kernel sees the serial inputs), then the rest of the sweep runs
serially with the real coefficient, and the redone states are written back after it (new
weights are published in the sweep's order on every rank: see `settle`); on overflow (or a
step that does not come) `before` is written back unchanged and the gradients stay. The norm
itself is computed after the worker has stopped, from the same sums in the same order.
Sub-groups are independent, so the order of the sweep changes nothing. The gradient hooks
fire after a parameter's last use in a backward, so a parameter whose sub-group is final is
not read again before the step (with fp32 weights that alias the masters, the worker
updates a home in place: only after its gradient is final).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from infinity.config import ZeroConfig
from infinity.swap.grad_tier import GradTier
from infinity.swap.split_state import grad_split
from infinity.swap.state_format import StateFormat
from infinity.swap.state_tier import StateTier, SubGroupState
from infinity.zero.sub_groups import FlatLayout

logger = logging.getLogger(__name__)

__all__ = [
    "Ahead", "AheadCopies", "OverlapStep", "ahead_nbytes", "overlap_limit", "overlap_plan",
    "overlap_sub_groups",
]  # fmt: skip


@dataclass(slots=True)
class Ahead:
    """A sub-group stepped ahead of the norm: in place, keeping a copy of its state from
    before (`before`), or, where the weights alias the masters (which forward reads), on a
    copy of its state (`after`, written over the live state once confirmed)."""

    new: torch.Tensor
    """Its new weights in the model dtype."""
    before: SubGroupState | None = None
    after: SubGroupState | None = None

    @property
    def nbytes(self) -> int:
        held = (t for state in (self.before, self.after) if state is not None for t in state)
        new = 0 if self.after is not None else self.new.nbytes  # else `after`'s master
        return new + sum(t.nbytes for t in held)


def overlap_limit(
    order: Sequence[int], numels: Sequence[int], on_host: Sequence[bool], max_numel: int
) -> int:
    """How many sub-groups at the head of `order` may be stepped early: each with its
    gradient sums on the host, together at most `max_numel` elements."""
    total = 0
    for pos, g in enumerate(order):
        total += numels[g]
        if not on_host[g] or total > max_numel:
            return pos
    return len(order)


def ahead_nbytes(numels: Sequence[int], fmt: StateFormat, itemsize: int, aliased: bool) -> int:
    """Host bytes of `AheadCopies` for sub-groups of `numels` elements: a copy of each one's
    state, and its new weights (`itemsize` bytes an element) unless the weights alias the
    masters (then the copy's master is the new weights)."""
    return sum(fmt.nbytes(n) + (0 if aliased else n * itemsize) for n in numels)


class AheadCopies:
    """[Note: the overlapped step's copies] The state copies and new-weight buffers of the
    sub-groups that may be stepped early, allocated once and reused at every step: a
    sub-group's copy is free again once its step is settled (`settle` publishes or redoes
    it, `restore` writes it back, and both a tier's `write` and the weights' commit copy
    out of it before they return). Held for the run, so the engine counts them in its
    host bytes and the estimate (`ahead_nbytes`) and the placement planner count the same
    bytes. Pages are touched only by the first step that uses them."""

    def __init__(
        self, numels: dict[int, int], fmt: StateFormat, dtype: torch.dtype, aliased: bool
    ) -> None:
        self._states = {g: fmt.views(torch.empty(fmt.nbytes(n), dtype=torch.uint8), n)
                        for g, n in numels.items()}  # fmt: skip
        self._new = {} if aliased else {g: torch.empty(n, dtype=dtype) for g, n in numels.items()}
        self.nbytes = ahead_nbytes(list(numels.values()), fmt, dtype.itemsize, aliased)

    @classmethod
    def of(
        cls, plan: tuple[list[int], int] | None, numels: Sequence[int], fmt: StateFormat,
        dtype: torch.dtype, aliased: bool,
    ) -> AheadCopies:  # fmt: skip
        """The copies of the sub-groups `plan` (`overlap_plan`'s) may step early."""
        early = {g: numels[g] for g in plan[0][: plan[1]]} if plan else {}
        return cls(early, fmt, dtype, aliased)

    def copy_of(self, g: int, state: SubGroupState) -> SubGroupState:
        """Sub-group g's copy, holding `state` (bitwise)."""
        copy = self._states[g]
        for dst, src in zip(copy, state, strict=True):
            dst.copy_(src.reshape(-1))
        return copy

    def new(self, g: int) -> torch.Tensor:
        """Sub-group g's buffer for its new weights (not aliased)."""
        return self._new[g]


class OverlapStep:
    """One step's speculative sweep (see [Note: the overlapped step]).

    `sweep` is the state tier's sweep in `order`; the first `limit` sub-groups of `order`
    may be stepped early, by `update(index, state) -> (Ahead, seconds)`; `groups_of(slot)`
    are the sub-groups
    a slot has elements in, `slots_in[g]` how many slots sub-group g holds. `key` is what
    the speculation assumed (lr, loss scale, step count): the step confirms only an equal
    one. `range` opens a named profiler range."""

    def __init__(
        self,
        sweep: Iterator[tuple[int, SubGroupState]],
        order: Sequence[int],
        *,
        limit: int,
        slots_in: Sequence[int],
        groups_of: Callable[[int], Sequence[int]],
        update: Callable[[int, SubGroupState], tuple[Ahead, float]],
        key: tuple,
        range: Callable[[str], contextlib.AbstractContextManager],
    ) -> None:
        self._sweep, self._order, self._limit = sweep, list(order), limit
        self._left = list(slots_in)
        self._groups_of, self._update, self._range = groups_of, update, range
        self.key = key
        self.ahead: dict[int, Ahead] = {}
        """The sub-groups stepped early, in the order they were."""
        self.spoiled: set[int] = set()
        """Sub-groups a gradient reached after they were final: never confirmed."""
        self.current: tuple[int, SubGroupState] | None = None
        """The sub-group the sweep holds, not stepped (the serial loop starts with it)."""
        self.compute_s = 0.0
        self.peak_bytes = 0
        self.stepped = self.confirmed = 0
        """Sub-groups stepped early, and those of them the step confirmed."""
        self.error: BaseException | None = None
        self._seen: set[int] = set()
        self._stop = self._done = False
        self._waiting: int | None = None  # the sub-group the worker waits for
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="infinity-step-ahead", daemon=True)
        self._thread.start()

    # -- the main thread ---------------------------------------------------------------
    def added(self, slot: int) -> None:
        """Slot `slot`'s gradient was added (in this backward)."""
        with self._cond:
            groups = self._groups_of(slot)
            if slot in self._seen:  # a second gradient: what was final is not
                self.spoiled.update(groups)
                return
            self._seen.add(slot)
            for g in groups:
                self._left[g] -= 1
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until the worker has nothing it can step (it waits for a gradient that is
        not final, or is done); False on timeout. For tests and benchmarks that want every
        sub-group that can be stepped early stepped before the step begins."""
        with self._cond:
            return self._cond.wait_for(self._is_idle, timeout_s)

    def _is_idle(self) -> bool:
        g = self._waiting
        return self._done or (g is not None and self._left[g] > 0)

    def stop(self) -> None:
        """Let the worker finish the sub-group it is stepping and wait for it; raise what
        it raised."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        if self.error is not None:
            raise self.error

    def restore(self, state_tier: StateTier) -> None:
        """Nothing of this step happens: close the sweep and write each sub-group stepped in
        place back as it was (the gradients are untouched)."""
        self.current = None
        self._sweep.close()
        for g, ahead in self.ahead.items():
            if ahead.before is not None:
                state_tier.write(g, ahead.before)
        self.ahead.clear()

    def settle(
        self,
        *,
        confirm: bool,
        run: Callable[[int, SubGroupState], None],
        publish: Callable[[int, Ahead], None],
        redo: Callable[[int, Ahead], None],
    ) -> None:
        """The step proper, once the norm is known: the sub-groups stepped early, in the
        sweep's order, published if `confirm` (and not spoiled), else `redo`ne (from their
        state before), then the serial pass `run` on the rest of the sweep.

        Each publication refreshes the gathered copies, a collective with several ranks,
        and how far each rank's worker got is its own timing: so every rank publishes in
        the sweep's order whatever it stepped early, kept or redid (a redo after the rest
        put a rank's collectives out of step with the others')."""
        kept = {g: a for g, a in self.ahead.items() if confirm and g not in self.spoiled}
        self.confirmed = len(kept)
        for g, ahead in self.ahead.items():  # the sweep's first sub-groups, in its order
            if g in kept:
                publish(g, ahead)
            else:
                redo(g, ahead)
        if self.current is not None:
            run(*self.current)
            self.current = None
        for g, state in self._sweep:
            run(g, state)
        self.ahead.clear()

    # -- the worker --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for pos, (g, state) in enumerate(self._sweep):
                self.current = (g, state)
                if not self._final(pos, g):
                    return  # the sweep stays suspended on g: the step goes on from here
                with self._range("infinity::zero::adam_ahead"):
                    self.ahead[g], seconds = self._update(g, state)
                self.compute_s += seconds
                self.stepped += 1
                self.current = None
                held = sum(a.nbytes for a in self.ahead.values())
                self.peak_bytes = max(self.peak_bytes, held)
        except BaseException as e:  # raised in the step, by `stop`
            self.current = None
            self.error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _final(self, pos: int, g: int) -> bool:
        """Wait until sub-group g's gradients are final; False if it is not to be stepped
        early (past the limit, or the step has begun)."""
        if pos >= self._limit:
            return False
        with self._cond:
            self._waiting = g
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._stop or self._left[g] <= 0)
            self._waiting = None
            return not self._stop and g not in self.spoiled


def overlap_sub_groups(
    zero: ZeroConfig, numels: Sequence[int], on_host: Sequence[bool]
) -> tuple[list[int], int] | None:
    """(the sweeps' order, how many of its first sub-groups may be stepped early) for
    sub-groups of `numels` elements whose gradient sums are in host memory where `on_host`,
    with `offload_optimizer.overlap_step`, else None (the engine's rule, which the estimate
    replays)."""
    offload = zero.offload_optimizer
    if not offload.overlap_step:
        return None
    order = list(range(len(numels)))[::-1]  # backward finishes the last slots first
    limit = overlap_limit(order, numels, on_host, offload.overlap_numel)
    return (order, limit) if limit else None


def overlap_plan(
    zero: ZeroConfig, layout: FlatLayout, grads: GradTier
) -> tuple[list[int], int] | None:
    """`overlap_sub_groups` for the gradient tier `grads`, whose sub-groups in host memory
    (`host_resident`) may be stepped early (see [Note: the overlapped step]); with the key
    on and nothing to step early, a warning says why."""
    numels, on_host = layout.sub_group_numels, grads.host_resident()
    plan = overlap_sub_groups(zero, numels, on_host)
    offload = zero.offload_optimizer
    if offload.overlap_step and plan is None and numels:
        logger.warning(
            "offload_optimizer.overlap_step: no sub-group can be stepped early, the step runs "
            "serially: the last sub-group (%d elements) %s",
            numels[-1],
            _why_not_early(offload, numels, on_host[-1]),
        )
    return plan


def _why_not_early(offload, numels: Sequence[int], on_host: bool) -> str:
    """Why the last sub-group (the first backward finishes) cannot be stepped early, and
    the key that would let it."""
    if on_host:
        return f"is over overlap_numel {offload.overlap_numel}; raise it or lower sub_group_size"
    if grad_split(numels, offload)[0] == len(numels):
        return (
            "has its gradient sums kept on the device (offload_optimizer.gradients_on_device "
            f"{offload.gradients_on_device}); early steps read sums in host memory: lower it"
        )
    return (
        "has its gradient sums spilled to NVMe with its state; set "
        "offload_optimizer.gradients_in_cpu true"
    )
