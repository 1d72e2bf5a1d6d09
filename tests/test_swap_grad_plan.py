"""`infinity.swap.grad_plan`: the NVMe gradient tier's buffer policy on its own.

A sink that simulates the buffers and the disk with integers checks, over every short
sequence of adds, every buffer count and every answer the disk's timing can give, that
nothing is lost (each sub-group's sum at the step is what was added), a buffer holds one
sub-group at a time, a read never lands in a buffer in use, and reads ahead never take
every buffer."""

from __future__ import annotations

import itertools

import pytest

from infinity.swap.grad_plan import (
    DISK_ROW_NUMEL,
    NORM_ROW_NUMEL,
    PARTIAL_FRACTION,
    GradPlan,
    GradResidency,
    disk_rows,
    grad_buffers,
)


class Sim:
    """Buffers and disk extents holding integers; every decision checked."""

    def __init__(self, plan: GradPlan) -> None:
        self.plan = plan
        self.buf: list[list[int] | None] = [None] * len(plan.owner)  # [sub-group, sum]
        self.disk = [0] * len(plan.numels)
        self.ops: list[str] = []

    def _take(self, g: int, b: int, value: int) -> None:
        assert self.plan.owner[b] is None and self.buf[b] is None, f"buffer {b} in use"
        self.buf[b] = [g, value]

    def zero(self, g: int, b: int) -> None:
        assert self.plan.residency[g] is GradResidency.ZERO
        self._take(g, b, 0)

    def load(self, g: int, b: int) -> None:
        assert self.plan.residency[g] is GradResidency.ON_NVME
        self._take(g, b, self.disk[g])
        self.ops.append("load")

    def landed(self, g: int, b: int) -> None:
        assert self.buf[b] is not None and self.buf[b][0] == g

    def write(self, g: int, b: int) -> None:
        assert self.buf[b] is not None and self.buf[b][0] == g
        assert self.plan.residency[g] is GradResidency.HOST
        self.disk[g] = self.buf[b][1]
        self.buf[b] = None
        self.ops.append("write")

    def read(self, g: int, b: int) -> None:
        assert self.plan.residency[g] is GradResidency.ON_NVME
        self._take(g, b, self.disk[g])
        self.ops.append("read")

    def free(self, g: int, b: int) -> None:
        assert self.buf[b] is not None and self.buf[b][0] == g
        self.buf[b] = None


def run(numels, adds, accum, buffers, idle, steps=2) -> Sim:
    """`steps` optimizer steps of `accum` passes over `adds` ((sub-group, elements, value))."""
    plan = GradPlan(numels, buffers)
    sim = Sim(plan)
    for _ in range(steps):
        want = [0] * len(numels)
        for _ in range(accum):
            for g, numel, value in adds:
                want[g] += value
                if plan.on_disk(g, numel):
                    sim.disk[g] += value  # the store adds these rows on disk
                    sim.ops.append("rows")
                    continue
                b = plan.add(g, sim, idle)
                assert sim.buf[b][0] == g and plan.where[g] == b
                sim.buf[b][1] += value
                plan.added(g, b, sim)
                # a buffer is free or can be written out: the next add never blocks
                assert any(o is None or plan.residency[o] is GradResidency.HOST for o in plan.owner)
                held = [o for o in plan.owner if o is not None]
                assert len(held) == len(set(held)) == len(plan.where)
        for g in range(len(numels)):
            if plan.residency[g] is GradResidency.ZERO:
                assert want[g] == 0
            b = plan.take(g, sim, idle)
            assert sim.buf[b] == [g, want[g]], f"sub-group {g}: {sim.buf[b]} != {want[g]}"
            plan.release(g, sim)
        assert all(r is GradResidency.ZERO for r in plan.residency)
        assert plan.owner == [None] * len(plan.owner)
    return sim


IDLE = {
    "always": lambda b: True,
    "never": lambda b: False,
    "first": lambda b: b == 0,
}


@pytest.mark.parametrize("buffers", [2, 3, 4])
def test_exhaustive_short_backwards_lose_nothing(buffers):
    numels = [32, 32, 32]
    choices = [(g, n) for g in range(3) for n in (32, 1)]  # whole, or small (on disk)
    count = 0
    for seq in itertools.product(choices, repeat=3):
        adds = [(g, n, 1 + 10 * k) for k, (g, n) in enumerate(seq)]
        for accum, idle in itertools.product((1, 2, 3), IDLE.values()):
            run(numels, adds, accum, buffers, idle)
            count += 1
    assert count == 6**3 * 3 * 3


def test_backward_over_many_sub_groups_spills_and_reads_behind():
    """A backward from the last sub-group to the first, twice: the second pass finds the
    lower sub-groups on disk and reads the one below ahead while filling the current."""
    numels = [64] * 6
    adds = [(g, 64, g + 1) for g in reversed(range(6))]
    sim = run(numels, adds, accum=2, buffers=3, idle=IDLE["always"], steps=1)
    assert "write" in sim.ops and "read" in sim.ops


def test_small_adds_to_spilled_sub_groups_go_to_disk():
    plan = GradPlan([PARTIAL_FRACTION * 4] * 3, 2)
    sim = Sim(plan)
    for g in (2, 1, 0):  # fill and spill
        plan.added(g, plan.add(g, sim, IDLE["always"]), sim)
    spilled = [g for g, r in enumerate(plan.residency) if r is GradResidency.ON_NVME]
    assert spilled
    g = spilled[0]
    assert plan.on_disk(g, 4) and not plan.on_disk(g, 5)
    assert not plan.on_disk(plan.owner.index(next(o for o in plan.owner if o is not None)), 1)


def test_too_few_buffers_is_refused():
    with pytest.raises(ValueError, match="at least 2 host buffers"):
        GradPlan([10], 1)


def test_buffers_and_rows():
    assert grad_buffers([10, 2000]) == (3, 8192)
    assert grad_buffers([10]) == (2, 4096)  # one sub-group needs no third buffer
    assert disk_rows(5000, 10, 100_000) == (4096, 8192)
    assert disk_rows(8190, 4, 9000) == (4096, 9000)
    assert DISK_ROW_NUMEL % NORM_ROW_NUMEL == 0  # an add re-measures whole rows of the norm
