"""The live-set policy: which parameters to fetch and which to release at each gather.

Owns the decisions only, over plain integers (a parameter is an index, a unit a tuple of
them, the trace a list of units): the live budget, making room (furthest next use first),
keeping what is reused soon, and prefetching along the trace. It holds no tensors and does no
I/O; a `Sink` is told each decision in order and carries it out. The coordinator
(`infinity.zero.coordinator`) applies it to parameter records; the estimate
(`infinity.estimate.param_traffic`) runs it over a traced order and counts the fetches. The
rules are the notes below.

[Note: the live budget] `max_live_parameters` is a hard bound on gathered elements, checked
at every fetch. A gather that does not fit first evicts resident parameters that no running
module needs (furthest next use first). Prefetch evicts only parameters whose next use comes
after the unit it fetches (so it never drops what is needed sooner to bring in what is
needed later); when that does not make room it stops, and resumes at the next gather. The
only excess allowed is what running forwards pin at once (the unit being gathered and the
modules enclosing it), which is why the bound is stated as budget + the largest unit;
anything beyond that is counted in `budget_overruns`. Backward pins nothing past the gather
itself: a module's weights are read back through the saved-tensor hooks, which gather again
whatever was evicted meanwhile.

[Note: reuse] After a unit ends, a parameter stays gathered if it is persistent (fewer
elements than `param_persistence_threshold`), if the trace says its next use comes within
`max_reuse_distance` gathered elements, or if the next use is already inside the prefetch
window (releasing it would only fetch it again).

[Note: frozen parameters stay gathered] A frozen parameter (no optimizer slot: a LoRA base)
never changes between iterations, so neither the end of its unit, nor of the iteration, nor
the optimizer step releases it; it counts against the live budget like any other and is
evicted (furthest next use first) only when a gather needs the room. A frozen base that fits
the budget is read from its home once, not at every micro-step; one that does not is read
as before. `abort` (after an error, or on close) still releases everything.

[Note: weights kept across micro batches] Trainable weights do not change between the
micro batches of one optimizer step, so a copy gathered in the first stays valid until the
step. The parameters `kept_mask` marks (the first trainable ones in model order, within
`zero_optimization.keep_weights_numel`: the earliest in forward are used again last in
backward, so the live set cannot keep them between their uses and they are copied most)
stay gathered from their first use to the step: neither the end of their unit nor of the
iteration releases them, eviction passes them over, and the step's quiesce releases them
before the optimizer writes new weights (the next step gathers afresh). They are counted
apart (`kept_numel`), outside the live budget, so every other decision (what is fetched,
evicted, prefetched) is the same whether they are held or not: the estimate counts each
kept parameter once a step and the rest as before. The values gathered are the home's, so
nothing computed changes, only how often the same bytes are copied.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

FAR = 1 << 62
"""The next use of a parameter the trace does not use again (or without a trace)."""


class Sink(Protocol):
    """Carries out the plan's decisions, one parameter at a time, in the order decided."""

    def fetch(self, i: int, needed: int | None) -> None:
        """Start bringing parameter `i` to the device, for the gather at trace position
        `needed` (None: off the trace); it counts against the budget from here."""

    def release(self, i: int) -> None:
        """Drop parameter `i`'s device copy (or its decided transfer)."""


Pinned = Callable[[int], bool]
"""Whether a parameter is needed by a running module (never evicted while so)."""


def _unpinned(i: int) -> bool:
    return False


class LiveTrace:
    """An order of gathers (each a tuple of parameter indices) with, per parameter, the
    positions that use it and the elements gathered before each position."""

    def __init__(self, units: Sequence[Sequence[int]], numel: Sequence[int]) -> None:
        self.units: list[tuple[int, ...]] = [tuple(u) for u in units]
        self.cum = [0]  # cum[p] = elements gathered by positions [0, p)
        self.uses: dict[int, list[int]] = {}
        for pos, unit in enumerate(self.units):
            self.cum.append(self.cum[-1] + sum(numel[i] for i in unit))
            for i in unit:
                self.uses.setdefault(i, []).append(pos)

    def __len__(self) -> int:
        return len(self.units)

    def next_use(self, i: int, after: int) -> int | None:
        """The first position > `after` that uses parameter `i`, or None."""
        positions = self.uses.get(i)
        if not positions:
            return None
        k = bisect.bisect_right(positions, after)
        return positions[k] if k < len(positions) else None

    def distance(self, start: int, stop: int) -> int:
        """Elements gathered by positions [start, stop)."""
        return self.cum[stop] - self.cum[start]


class LivePlan:
    """The live set of one process under `budget` elements, prefetching `window` elements
    ahead along the trace and keeping what is reused within `reuse` elements.

    Parameters are registered with `add` (their index is the order of registration). A
    trace is followed between `begin` and `end`; `advance` moves the cursor to each gather's
    position (None: off the trace for the rest of the iteration)."""

    def __init__(self, *, budget: int, window: int, reuse: int) -> None:
        self.budget = int(budget)
        self.window = int(window)
        self.reuse = int(reuse)
        self.numel: list[int] = []
        self.persistent: list[bool] = []
        self.frozen: list[bool] = []
        self.kept: list[bool] = []
        """Kept across the micro batches of a step (see [Note: weights kept across micro
        batches])."""
        self.held: dict[int, None] = {}
        """Parameters whose fetch was decided and not released (persistent ones included)."""
        self.resident: dict[int, None] = {}
        """The non-persistent ones of `held`, in the order fetched (eviction ties keep it)."""
        self.live_numel = 0
        """Elements held under the budget (persistent ones included, kept ones not)."""
        self.peak_live_numel = 0
        self.kept_numel = 0
        """Elements of the kept parameters held (outside the budget)."""
        self.peak_kept_numel = 0
        self.largest_unit = 0
        """Elements of the largest unit gathered so far: the allowance over the budget."""
        self.overruns = 0
        """Gathers that left more than budget + the largest unit gathered."""
        self.trace: LiveTrace | None = None
        self.cursor = 0
        self.upto = 0
        """The position prefetch has fetched up to (exclusive)."""
        self.on_track = False

    def add(self, numel: int, *, persistent: bool, frozen: bool, kept: bool = False) -> int:
        """Register a parameter; returns its index."""
        if kept and (persistent or frozen):
            raise ValueError("a kept parameter is trainable and not persistent (kept_mask)")
        self.numel.append(int(numel))
        self.persistent.append(bool(persistent))
        self.frozen.append(bool(frozen))
        self.kept.append(bool(kept))
        return len(self.numel) - 1

    def _budgeted(self, ids: Collection[int]) -> int:
        """Elements of `ids` that count against the budget (all but the kept ones)."""
        return sum(self.numel[i] for i in ids if not self.kept[i])

    # -- the trace -------------------------------------------------------------------------

    def begin(self, trace: LiveTrace | None) -> None:
        """An iteration starts, following `trace` (None: nothing traced yet)."""
        self.trace = trace
        self.cursor = 0
        self.upto = 0
        self.on_track = trace is not None

    def end(self) -> None:
        self.trace = None

    def advance(self, pos: int | None) -> None:
        """A gather at trace position `pos`; None: the order left the trace."""
        if pos is None:
            self.on_track = False
        else:
            self.cursor = pos + 1

    @property
    def following(self) -> bool:
        return self.trace is not None and self.on_track

    # -- decisions -------------------------------------------------------------------------

    def holds(self, i: int) -> bool:
        return i in self.held

    def gather(self, unit: Sequence[int], sink: Sink, pinned: Pinned = _unpinned) -> list[int]:
        """Every parameter of `unit` fetched, after making room for those not held; returns
        the ones fetched now (in unit order)."""
        total = sum(self.numel[i] for i in unit)
        if total > self.largest_unit:
            self.largest_unit = total
        want = [i for i in unit if i not in self.held]
        need = self._budgeted(want)
        if need:
            self.make_room(need, set(unit), sink, pinned)
        here = self.cursor - 1 if self.following else None
        for i in want:
            if i not in self.held:
                self.fetch(i, sink, here)
        return want

    def gather_one(self, i: int, sink: Sink, pinned: Pinned = _unpinned) -> bool:
        """Parameter `i` fetched outside its unit; False when it was held already."""
        if i in self.held:
            return False
        self.make_room(self._budgeted((i,)), (), sink, pinned)
        self.fetch(i, sink, None)
        return True

    def make_room(
        self, need: int, running: Collection[int], sink: Sink, pinned: Pinned = _unpinned
    ) -> None:
        """Evict (furthest next use first) until `need` more elements fit; counts an
        overrun when even that leaves more than the budget + the largest unit."""
        if self.live_numel + need > self.budget:
            self._evict(need, running, sink, pinned, before=None)
            if self.live_numel + need > self.budget + self.largest_unit:
                self.overruns += 1

    def keep(self, i: int, pos: int | None) -> bool:
        """Whether `i` stays gathered after the unit at trace position `pos` ends."""
        if self.persistent[i] or self.frozen[i] or self.kept[i]:
            return True
        trace = self.trace
        if trace is None or pos is None or not self.on_track:
            return False
        nxt = trace.next_use(i, pos)
        if nxt is None:
            return False
        return nxt < self.upto or trace.distance(pos + 1, nxt) <= self.reuse

    def settle(self, i: int, pos: int | None, sink: Sink) -> None:
        """The unit at `pos` that used `i` ended (and nothing pins `i`): release it unless
        it is kept."""
        if not self.keep(i, pos):
            self.release(i, sink)

    def release_all(
        self,
        sink: Sink,
        pinned: Pinned = _unpinned,
        *,
        keep_frozen: bool = False,
        keep_kept: bool = False,
    ) -> None:
        """Release every unpinned non-persistent parameter (frozen ones stay with
        `keep_frozen`, kept ones with `keep_kept`: the end of a micro batch, not the step)."""
        for i in list(self.resident):
            stays = (keep_frozen and self.frozen[i]) or (keep_kept and self.kept[i])
            if not pinned(i) and not stays:
                self.release(i, sink)

    def prefetch(self, running: Collection[int], sink: Sink, pinned: Pinned = _unpinned) -> bool:
        """Fetch the units within `window` elements of the cursor, in order, while they fit
        (evicting only what is needed after each); False when there is nothing to follow."""
        trace = self.trace
        if trace is None or not self.on_track or self.window <= 0:
            return False
        pos = max(self.upto, self.cursor)
        while pos < len(trace):
            if trace.distance(self.cursor, pos) >= self.window:
                break
            want = [i for i in trace.units[pos] if i not in self.held]
            need = self._budgeted(want)
            if self.live_numel + need > self.budget:
                self._evict(need, running, sink, pinned, before=pos)
                if self.live_numel + need > self.budget:
                    break  # prefetch waits for room
            for i in want:
                if i not in self.held:
                    self.fetch(i, sink, pos)
            pos += 1
        self.upto = pos
        return True

    # -- state -----------------------------------------------------------------------------

    def fetch(self, i: int, sink: Sink, needed: int | None) -> None:
        sink.fetch(i, needed)  # first: a transfer that fails to start is not counted
        self.hold(i)

    def hold(self, i: int) -> None:
        """Count `i` as fetched (a sink may say so itself: once is enough)."""
        if i in self.held:
            return
        self.held[i] = None
        if not self.persistent[i]:
            self.resident[i] = None
        if self.kept[i]:
            self.kept_numel += self.numel[i]
            self.peak_kept_numel = max(self.peak_kept_numel, self.kept_numel)
            return
        self.live_numel += self.numel[i]
        if self.live_numel > self.peak_live_numel:
            self.peak_live_numel = self.live_numel

    def release(self, i: int, sink: Sink) -> None:
        """Release `i` if it is held and not persistent."""
        if i not in self.resident:
            return
        sink.release(i)
        self.drop(i)

    def drop(self, i: int) -> None:
        """Count `i` as released, without telling the sink (a sink may say so itself, or
        its transfer failed and nothing is left)."""
        if i in self.held:
            del self.held[i]
            self.resident.pop(i, None)
            if self.kept[i]:
                self.kept_numel -= self.numel[i]
            else:
                self.live_numel -= self.numel[i]

    def _evict(
        self,
        need: int,
        running: Collection[int],
        sink: Sink,
        pinned: Pinned,
        before: int | None,
    ) -> None:
        """Release unpinned resident parameters outside `running`, furthest next use first
        (ties in the order fetched), until `need` more fit; with `before`, only those not
        needed before that position."""
        trace = self.trace if self.on_track else None
        here = self.cursor

        def next_use(i: int) -> int:
            nxt = trace.next_use(i, here - 1) if trace is not None else None
            return FAR if nxt is None else nxt

        victims = [
            (next_use(i), i)
            for i in self.resident
            if not (pinned(i) or self.kept[i] or i in running)
        ]
        victims.sort(key=lambda v: v[0], reverse=True)
        for nxt, i in victims:
            if self.live_numel + need <= self.budget:
                break
            if before is not None and nxt <= before:
                break
            self.release(i, sink)


def kept_mask(
    numels: Sequence[int], trainable: Sequence[bool], persistent: Sequence[bool], budget: int
) -> list[bool]:
    """Which parameters stay gathered across the micro batches of a step (see [Note: weights
    kept across micro batches]): trainable, non-persistent ones in model order while their
    elements fit `budget` (one that does not fit is passed over for smaller ones after it).
    A function of the sizes only, so every rank and the estimate choose the same."""
    left = int(budget)
    mask = []
    for n, train, persists in zip(numels, trainable, persistent, strict=True):
        keep = train and not persists and 0 < n <= left
        left -= n if keep else 0
        mask.append(keep)
    return mask
