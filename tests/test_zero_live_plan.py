"""`infinity.zero.live_plan`: the live-set planner on its own, over plain integers.

Exhaustive small cases (every trace of a few parameters, every budget and window): the budget
is never exceeded beyond the unit being gathered, every gather finds its parameters, the sink
is told a consistent story, and the same inputs give the same decisions."""

from __future__ import annotations

import itertools

import pytest

from infinity.zero.live_plan import LivePlan, LiveTrace, kept_mask


class Checked:
    """A sink that keeps its own live set and checks each decision against it."""

    def __init__(self, plan: LivePlan) -> None:
        self.plan = plan
        self.live: set[int] = set()
        self.log: list[tuple[str, int, int | None]] = []
        self.limit = plan.budget

    def fetch(self, i: int, needed: int | None) -> None:
        assert i not in self.live, f"fetch of {i}, already live"
        self.live.add(i)
        self.log.append(("fetch", i, needed))
        live = sum(self.plan.numel[k] for k in self.live if not self.plan.kept[k])
        assert live <= self.limit, f"{live} elements live, limit {self.limit}"

    def release(self, i: int) -> None:
        assert i in self.live, f"release of {i}, not live"
        assert not self.plan.persistent[i]
        self.live.remove(i)
        self.log.append(("release", i, None))


def drive(plan: LivePlan, units: list[tuple[int, ...]], sink: Checked, iterations: int = 3):
    """Iterations as the hooks drive the coordinator: prefetch, then per gather the unit,
    prefetch, and the unit's end; the end of the iteration keeps frozen parameters."""
    order = LiveTrace(units, plan.numel)
    for _ in range(iterations):
        plan.begin(order)
        plan.prefetch((), sink)
        for pos, unit in enumerate(units):
            plan.advance(pos)
            total = sum(plan.numel[i] for i in unit)
            sink.limit = max(plan.budget, total)
            plan.gather(unit, sink)
            assert all(i in sink.live or plan.persistent[i] for i in unit)
            assert plan.live_numel == sum(plan.numel[i] for i in plan.held)
            plan.prefetch(set(unit), sink)
            for i in unit:
                plan.settle(i, pos, sink)
        plan.release_all(sink, keep_frozen=True)
        plan.end()
        assert {i for i in sink.live if not (plan.frozen[i] or plan.persistent[i])} == set()


def make(numel, budget, window, reuse, *, frozen=(), persistent=(), kept=()) -> LivePlan:
    plan = LivePlan(budget=budget, window=window, reuse=reuse)
    for i, n in enumerate(numel):
        plan.add(n, persistent=i in persistent, frozen=i in frozen, kept=i in kept)
    return plan


def _traces(params: int, length: int):
    units = [u for k in (1, 2) for u in itertools.combinations(range(params), k)]
    yield from itertools.product(units, repeat=length)


@pytest.mark.parametrize("frozen", [(), (0,), (0, 2)])
def test_exhaustive_small_traces_keep_the_budget(frozen):
    numel = [1, 2, 3]
    count = 0
    for length in (2, 3):
        for units in _traces(len(numel), length):
            for budget, window, reuse in itertools.product((1, 3, 5, 6), (0, 2, 4, 99), (0, 3)):
                plan = make(numel, budget, window, reuse, frozen=frozen)
                sink = Checked(plan)
                drive(plan, list(units), sink)
                assert plan.overruns == 0
                count += 1
    assert count == (6**2 + 6**3) * 4 * 4 * 2  # every trace, budget, window, reuse


def test_fetches_name_the_gather_they_are_for():
    numel = [2, 2, 2, 2]
    units = [(0,), (1,), (2,), (3,), (2,), (1,), (0,)]
    for budget, window in itertools.product((2, 4, 6, 8), (0, 2, 4, 8, 99)):
        plan = make(numel, budget, window, 0)
        sink = Checked(plan)
        drive(plan, units, sink, iterations=1)
        for verb, i, needed in sink.log:
            if verb == "fetch":
                assert needed is not None and i in units[needed]


def test_same_inputs_same_decisions():
    """Every rank must decide the same: the decisions are a function of the inputs only."""
    units = [(0, 1), (2,), (3, 4), (2,), (0, 1), (4,)]
    logs = []
    for _ in range(2):
        plan = make([5, 1, 4, 2, 3], budget=7, window=6, reuse=2)
        sink = Checked(plan)
        drive(plan, units, sink)
        logs.append(sink.log)
    assert logs[0] == logs[1] and logs[0]


def test_a_budget_that_holds_everything_fetches_frozen_once():
    units = [(0,), (1,), (2,), (2,), (1,), (0,)]
    plan = make([3, 3, 3], budget=9, window=0, reuse=0, frozen=(0, 1, 2))
    sink = Checked(plan)
    drive(plan, units, sink, iterations=4)
    assert [e for e in sink.log if e[0] == "fetch"] == [
        ("fetch", 0, 0),
        ("fetch", 1, 1),
        ("fetch", 2, 2),
    ]
    assert not [e for e in sink.log if e[0] == "release"]


def test_trainable_released_at_the_end_of_each_iteration():
    units = [(0,), (1,), (1,), (0,)]
    plan = make([3, 3], budget=9, window=0, reuse=10**9)
    sink = Checked(plan)
    drive(plan, units, sink, iterations=2)
    fetches = [e for e in sink.log if e[0] == "fetch"]
    assert len(fetches) == 4  # each parameter once per iteration: kept for its reuse


def test_eviction_takes_the_furthest_next_use_first():
    # 0 and 1 resident; gathering 2 needs room for one: 1 is used last, so it goes.
    units = [(0,), (1,), (2,), (0,), (1,)]
    plan = make([1, 1, 1], budget=2, window=0, reuse=10**9)
    sink = Checked(plan)
    plan.begin(LiveTrace(units, plan.numel))
    for pos in range(3):
        plan.advance(pos)
        plan.gather(units[pos], sink)
    assert sink.log[-2:] == [("release", 1, None), ("fetch", 2, 2)]


def test_prefetch_waits_instead_of_evicting_what_is_needed_sooner():
    units = [(0,), (1,), (2,), (0,)]
    plan = make([2, 2, 2], budget=4, window=99, reuse=0)
    sink = Checked(plan)
    plan.begin(LiveTrace(units, plan.numel))
    plan.prefetch((), sink)
    # 0 and 1 fit; 2 would need 0 or 1 out, both needed before it: prefetch stops there.
    assert [i for v, i, _ in sink.log if v == "fetch"] == [0, 1]
    assert plan.upto == 2


def test_persistent_parameters_count_and_stay():
    units = [(0, 1), (2,), (0, 1)]
    plan = make([1, 4, 4], budget=5, window=0, reuse=0, persistent=(0,))
    sink = Checked(plan)
    drive(plan, units, sink, iterations=2)
    assert plan.holds(0) and 0 in sink.live
    assert ("release", 0, None) not in sink.log


def test_off_the_trace_evicts_in_the_order_fetched():
    plan = make([1, 1, 1], budget=2, window=4, reuse=4)
    sink = Checked(plan)
    plan.begin(None)
    for unit in [(0,), (1,), (2,)]:
        plan.advance(None)
        plan.gather(unit, sink)
        assert not plan.prefetch(set(unit), sink)
    assert sink.log == [
        ("fetch", 0, None),
        ("fetch", 1, None),
        ("release", 0, None),
        ("fetch", 2, None),
    ]


def test_pinned_parameters_are_not_evicted():
    plan = make([2, 2, 2], budget=4, window=0, reuse=0)
    sink = Checked(plan)
    sink.limit = 6
    plan.begin(None)
    plan.gather((0,), sink)
    plan.gather((1,), sink)
    plan.gather((2,), sink, pinned=lambda i: i in (0, 1))
    assert plan.live_numel == 6 and plan.overruns == 0  # over by the unit: allowed
    plan.gather_one(0, sink)  # held already
    assert plan.live_numel == 6


# -- weights kept across micro batches ------------------------------------------------------


def _micro_batches(plan: LivePlan, units, sink: Checked, count: int) -> list[list]:
    """`count` micro batches of one step (the kept parameters stay from one to the next),
    then the step's release; the events of each micro batch."""
    order = LiveTrace(units, plan.numel)
    events = []
    for _ in range(count):
        start = len(sink.log)
        plan.begin(order)
        plan.prefetch((), sink)
        for pos, unit in enumerate(units):
            plan.advance(pos)
            plan.gather(unit, sink)
            assert all(i in sink.live for i in unit)
            plan.prefetch(set(unit), sink)
            for i in unit:
                plan.settle(i, pos, sink)
        plan.release_all(sink, keep_frozen=True, keep_kept=True)
        plan.end()
        events.append(sink.log[start:])
    plan.release_all(sink, keep_frozen=True)  # the step
    assert not sink.live and plan.kept_numel == 0 and plan.live_numel == 0
    return events


@pytest.mark.parametrize("kept", [(0,), (2,), (0, 1), (0, 1, 2)])
def test_kept_parameters_are_fetched_once_a_step_and_change_nothing_else(kept):
    """Over every small trace, budget, window and reuse distance: a kept parameter is fetched
    once in a step of three micro batches and released only by the step, the budget holds
    without them, and every other decision is the same in each micro batch (whether the
    kept ones are held yet or not)."""
    numel = [1, 2, 3]
    for length in (2, 3):
        for units in _traces(len(numel), length):
            for budget, window, reuse in itertools.product((1, 3, 6), (0, 2, 99), (0, 3)):
                plan = make(numel, budget, window, reuse, kept=kept)
                sink = Checked(plan)
                sink.limit = budget + sum(numel)  # the running unit may exceed the budget
                events = _micro_batches(plan, units, sink, 3)
                used = {i for u in units for i in u}
                for i in kept:
                    fetches = [e for e in sink.log if e[:2] == ("fetch", i)]
                    assert len(fetches) == (i in used)
                    assert not [e for ev in events for e in ev if e[:2] == ("release", i)]
                others = [[e for e in ev if e[1] not in kept] for ev in events]
                assert others[0] == others[1] == others[2]
                assert plan.overruns == 0


def test_kept_mask_takes_trainable_weights_in_model_order_within_the_budget():
    numels = [4, 1, 3, 5, 2, 2]
    trainable = [True, True, False, True, True, True]
    persistent = [False, True, False, False, False, False]
    assert kept_mask(numels, trainable, persistent, 0) == [False] * 6
    # 4 fits, 1 is persistent, 3 is frozen, 5 does not fit what is left (3): 2 and 2 do not
    # both fit either; the first does.
    assert kept_mask(numels, trainable, persistent, 7) == [
        True, False, False, False, True, False,
    ]  # fmt: skip
    assert kept_mask(numels, trainable, persistent, 10**9) == [
        True, False, False, True, True, True,
    ]  # fmt: skip


def test_a_kept_parameter_must_be_trainable_and_not_persistent():
    plan = LivePlan(budget=4, window=0, reuse=0)
    with pytest.raises(ValueError, match="kept_mask"):
        plan.add(2, persistent=False, frozen=True, kept=True)
