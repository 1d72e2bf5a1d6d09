"""NvmeStateTier: the StateTier contract on disk, its pipeline, and failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _fake_aio import FakeAio

from infinity.config.sections import AioConfig
from infinity.io.aio import AioHandle
from infinity.io.aio_checks import available_backends
from infinity.optim.functional import adam_step_flat
from infinity.swap.nvme_state import NvmeStateError, NvmeStateTier, Residency
from infinity.swap.state_tier import HostStateTier, SubGroupState

NUMELS = [1000, 1, 3000, 0, 777, 4096, 513]


def _masters(numels, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64).to(torch.bfloat16) for n in numels]


def _update(i: int, s: SubGroupState, step: int) -> None:
    """A deterministic stand-in for an optimizer step."""
    s.exp_avg.mul_(0.9).add_(s.master, alpha=0.1 * (i + 1))
    s.exp_avg_sq.mul_(0.99).addcmul_(s.master, s.master, value=0.01)
    s.master.sub_(s.exp_avg / (s.exp_avg_sq.sqrt() + 1e-8), alpha=1e-3 * step)


def _run(store, masters, steps):
    for i, m in enumerate(masters):
        store.initialize(i, m)
    for step in range(1, steps + 1):
        seen = []
        for i, s in store.sweep():
            seen.append(i)
            _update(i, s, step)
        assert seen == list(range(len(store.numels)))
    return [store.read(i) for i in range(len(store.numels))]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("buffers", [3, 5])
def test_bitwise_equal_to_host_store(swap, lazy, buffers):
    masters = _masters(NUMELS)
    want = _run(HostStateTier(NUMELS), masters, steps=3)
    with NvmeStateTier(NUMELS, store=swap, aio=FakeAio(lazy=lazy), buffer_count=buffers) as s:
        got = _run(s, masters, steps=3)
        assert all(r is Residency.ON_NVME for r in s.residency)
        assert s.stats.bytes_read > 0 and s.stats.bytes_written > 0
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            assert a.dtype == b.dtype == torch.float32
            assert torch.equal(a, b)


@pytest.mark.parametrize("numels", [[777], [4096, 100]], ids=["one", "two"])
def test_fewer_sub_groups_than_buffers_get_one_buffer_each(swap, numels):
    """buffer_count 4 over one or two sub-groups (LoRA adapters): only as many buffers are
    allocated, and the sweeps give the host store's results."""
    masters = _masters(numels)
    want = _run(HostStateTier(numels), masters, steps=3)
    with NvmeStateTier(numels, store=swap, aio=FakeAio(lazy=True), buffer_count=4) as s:
        assert s.pool.buffer_count == len(numels)
        got = _run(s, masters, steps=3)
    for w, g in zip(want, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, g, strict=True))


def test_adam_steps_bitwise_equal_to_host_store(swap):
    numels = [4096, 1000, 3]
    g = torch.Generator().manual_seed(3)
    grads = [[torch.randn(n, generator=g) for n in numels] for _ in range(3)]
    results = []
    for store in (
        HostStateTier(numels),
        NvmeStateTier(numels, store=swap, aio=FakeAio(lazy=True), buffer_count=3),
    ):
        for i, m in enumerate(_masters(numels, seed=4)):
            store.initialize(i, m)
        for step, step_grads in enumerate(grads, 1):
            for i, s in store.sweep():
                adam_step_flat(
                    s.master, step_grads[i], s.exp_avg, s.exp_avg_sq, step=step, lr=1e-2,
                    weight_decay=0.1, backend="torch",
                )  # fmt: skip
        results.append([store.read(i) for i in range(len(numels))])
        store.close()
    for w, g in zip(*results, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, g, strict=True))


@pytest.mark.parametrize("backend", available_backends())
def test_bitwise_equal_to_host_store_real_io(swap, backend):
    masters = _masters(NUMELS, seed=1)
    want = _run(HostStateTier(NUMELS), masters, steps=2)
    aio = AioHandle(block_size=8192, queue_depth=4, backend=backend)
    with aio, NvmeStateTier(NUMELS, store=swap, aio=aio, buffer_count=3) as s:
        got = _run(s, masters, steps=2)
    for w, g in zip(want, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w, g, strict=True))


def test_aio_config_makes_an_owned_handle(swap):
    with NvmeStateTier([100, 200], store=swap, aio=AioConfig(backend="posix")) as s:
        assert s.aio.backend == "posix"
        s.initialize(1, torch.ones(200))
        assert torch.equal(s.read(1).master, torch.ones(200))
    assert s.aio._closed


def test_read_ahead_issued_before_caller_gets_control(swap):
    aio = FakeAio(lazy=True)
    store = NvmeStateTier(NUMELS, store=swap, aio=aio, buffer_count=3)
    offsets = {store.store.extent("optim", f"subgroup.{i}").offset: i for i in range(7)}
    for i, m in enumerate(_masters(NUMELS)):
        store.initialize(i, m)
    aio.log.clear()
    events = []
    for i, s in store.sweep():
        issued = [(op, offsets[off]) for op, _, off in aio.log]
        events.append(issued)
        assert ("read", i + 1) in issued or i + 1 == len(NUMELS)
        if i >= 2:  # the write-back of i-2 at the latest was queued before i was handed out
            assert ("write", i - 2) in issued
        assert ("write", i) not in issued
        s.master.add_(1)
    ops = [(op, offsets[off]) for op, _, off in aio.log]
    n = len(NUMELS)
    # every sub-group read once and written once, then the next sweep's first reads
    assert sorted(o for op, o in ops[: 2 * n] if op == "read") == list(range(n))
    assert sorted(o for op, o in ops[: 2 * n] if op == "write") == list(range(n))
    assert ops[2 * n :] == [("read", 0), ("read", 1), ("read", 2)]
    store.close()


def test_next_sweep_prefetch_is_used_or_dropped(swap):
    aio = FakeAio(lazy=True)
    store = NvmeStateTier([100] * 4, store=swap, aio=aio, buffer_count=3)
    for _ in store.sweep():
        pass
    aio.log.clear()
    for i, s in store.sweep():  # sub-groups 0-2 were read at the end of the last sweep
        s.master.fill_(i)
    assert sum(op == "read" for op, _, _ in aio.log) == 1 + 3
    new = SubGroupState(*(torch.full((100,), 9.0) for _ in range(3)))
    store.write(0, new)  # drops the reads of the old state issued for the next sweep
    assert store.pool.free_count == 3
    it = store.sweep()
    first = next(it)
    assert first[0] == 0 and torch.all(first[1].exp_avg == 9.0)
    first[1].exp_avg.fill_(5.0)
    store.close()  # closes the suspended sweep first: its change is kept
    assert store.pool.free_count == 3 and not store._writes
    assert [r.name for r in store.residency] == ["ON_NVME"] * 4
    ext = store.store.extent("optim", "subgroup.0")
    with open(ext.path, "rb") as f:
        f.seek(ext.offset + 400)
        assert torch.all(torch.frombuffer(bytearray(f.read(400)), dtype=torch.float32) == 5.0)
    no_prefetch = NvmeStateTier(
        [100] * 4, store=swap, aio=FakeAio(), prefetch_next_sweep=False, kind="optim.b"
    )
    for _ in no_prefetch.sweep():
        pass
    assert no_prefetch.pool.free_count == 4 and not no_prefetch._ahead
    no_prefetch.close()


def test_reads_are_queued_before_the_write_back_of_the_stepped_sub_group(swap):
    aio = FakeAio(lazy=True)
    store = NvmeStateTier([1024] * 6, store=swap, aio=aio, buffer_count=3)
    offsets = {store.store.extent("optim", f"subgroup.{i}").offset: i for i in range(6)}
    for i, _ in store.sweep():
        if i == 2:
            for t in store._writes:  # the disk finishes the write-back of 1 during this step
                t.future._finish()
            mark = len(aio.log)
    after = [(op, offsets[off]) for op, _, off in aio.log[mark:]]
    # the buffer of sub-group 1 takes the read of 4 before sub-group 2 is written back
    assert after.index(("read", 4)) < after.index(("write", 2))
    store.close()


def test_write_of_previous_overlaps_step_of_current(swap):
    aio = FakeAio(lazy=True)
    store = NvmeStateTier([4096] * 5, store=swap, aio=aio, buffer_count=4)
    pending_writes = []
    for _i, _ in store.sweep():
        pending_writes.append(len(store._writes))
    # from the second sub-group on, the previous one's write-back is still in flight
    assert all(n >= 1 for n in pending_writes[1:])
    assert not store._writes  # exhausting the iterator waited for all of them
    store.close()


def test_breaking_out_keeps_changes_and_drains(swap):
    store = NvmeStateTier(NUMELS, store=swap, aio=FakeAio(lazy=True), buffer_count=4)
    it = store.sweep()
    for i, s in it:
        s.master.fill_(float(i + 7))
        if i == 2:
            break
    it.close()
    assert not store._writes and store.pool.free_count == 4
    assert all(r is Residency.ON_NVME for r in store.residency)
    for i in range(3):
        assert torch.all(store.read(i).master == float(i + 7))
    assert torch.all(store.read(4).master == 0)
    store.close()


def test_calls_during_a_sweep_are_refused(swap):
    store = NvmeStateTier([10, 10], store=swap, aio=FakeAio())
    it = store.sweep()
    next(it)
    with pytest.raises(RuntimeError, match="during a sweep"):
        store.read(1)
    it.close()
    store.read(1)
    store.close()


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_enospc_mid_sweep_stops_cleanly(swap, lazy):
    numels = [2000] * 6
    aio = FakeAio(lazy=lazy)
    store = NvmeStateTier(numels, store=swap, aio=aio, buffer_count=3)
    for i, m in enumerate(_masters(numels)):
        store.initialize(i, m)
    before = [store.read(i) for i in range(len(numels))]
    aio.fail_write = aio.writes + 2  # the write-back of sub-group 2 fails
    stepped = []
    with pytest.raises(NvmeStateError, match="No space left on device") as err:
        for i, s in store.sweep():
            stepped.append(i)
            s.master.add_(1.0)
    assert "sub-group 2" in str(err.value) and "checkpoint" in str(err.value)
    assert store.residency[2] is Residency.FAILED
    assert max(stepped) < len(numels) - 1 or lazy  # stopped at the failure, not at the end
    assert store.pool.free_count == 3  # no buffer left lent to a transfer
    # nothing torn is ever handed out again
    for call in (
        lambda: store.read(0),
        lambda: list(store.sweep()),
        lambda: store.write(0, before[0]),
    ):
        with pytest.raises(NvmeStateError, match="earlier transfer failed"):
            call()
    store.close()


def test_enospc_in_initialize_surfaces_at_next_use(swap):
    aio = FakeAio(lazy=True, fail_write=1)
    store = NvmeStateTier([100, 100, 100], store=swap, aio=aio, buffer_count=3)
    for i, m in enumerate(_masters([100] * 3)):
        store.initialize(i, m)
    with pytest.raises(NvmeStateError, match="sub-group 1"):
        store.close()
    store.close()  # reported once; idempotent


def test_write_and_read_roundtrip_and_checks(swap):
    store = NvmeStateTier([5, 9], store=swap, aio=FakeAio())
    st = SubGroupState(*(torch.arange(9, dtype=torch.float32) * k for k in (1, 2, 3)))
    store.write(1, st)
    back = store.read(1)
    assert all(torch.equal(a, b) for a, b in zip(st, back, strict=True))
    back.master.fill_(-1)  # a copy: the stored state does not change
    assert torch.equal(store.read(1).master, st.master)
    with pytest.raises(ValueError, match="has 9 elements"):
        store.initialize(0, torch.zeros(9))
    with pytest.raises(IndexError):
        store.read(2)
    with pytest.raises(ValueError, match="at least 3"):
        NvmeStateTier([1], store=swap, aio=FakeAio(), buffer_count=2)
    store.close()
    with pytest.raises(NvmeStateError, match="closed"):
        store.read(0)


def test_uninitialized_sub_groups_read_as_zero(swap):
    store = NvmeStateTier([333], store=swap, aio=FakeAio())
    assert all(torch.count_nonzero(t) == 0 for t in store.read(0))
    store.close()


def test_memory_stats(swap):
    store = NvmeStateTier([1024, 2048], store=swap, aio=FakeAio(), buffer_count=3)
    for _ in store.sweep():
        pass
    m = store.memory_stats()
    assert m["nvme_optim_bytes_read"] == m["nvme_optim_bytes_written"] == 3 * 4 * 3072
    assert m["optim_host_buffer_bytes"] == 2 * 3 * 4 * 2048  # two sub-groups: two buffers
    assert 0 < m["optim_host_buffer_peak_bytes"] <= m["optim_host_buffer_bytes"]
    store.close()


@pytest.mark.parametrize("backend", available_backends())
def test_real_write_failure_mid_sweep_in_child(tmp_path, backend):
    child = Path(__file__).with_name("_nvme_fsize_child.py")
    proc = subprocess.run(
        [sys.executable, str(child), str(tmp_path), backend],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "File too large" in out["error"] and "resume from the last checkpoint" in out["error"]
    assert "FAILED" in out["residency"] and "RESIDENT" not in out["residency"]
    assert out["free_buffers"] == 3
    assert "earlier transfer failed" in out["later"]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("backend", available_backends())
def test_read_range_reads_just_one_fields_share(swap, backend):
    masters = _masters(NUMELS)
    host = HostStateTier(NUMELS)
    want = _run(host, masters, steps=2)
    with NvmeStateTier(NUMELS, store=swap, aio=AioConfig(backend=backend), buffer_count=3) as s:
        _run(s, masters, steps=2)
        gen = torch.Generator().manual_seed(1)
        for i, n in enumerate(NUMELS):
            for k, field in enumerate(SubGroupState._fields):
                start = int(torch.randint(0, n + 1, (1,), generator=gen))
                stop = int(torch.randint(start, n + 1, (1,), generator=gen))
                before = s.stats.bytes_read
                got = s.read_range(i, field, start, stop)
                assert torch.equal(got, want[i][k][start:stop]), (i, field, start, stop)
                assert torch.equal(host.read_range(i, field, start, stop), got)
                # only the pages holding the range (plus at most one page either side)
                assert s.stats.bytes_read - before <= (stop - start) * 4 + 2 * 4096
        with pytest.raises(ValueError, match="not a field of the adamw state; its fields are"):
            s.read_range(0, "grad", 0, 1)
        with pytest.raises(ValueError, match="start <= stop"):
            s.read_range(0, "master", 5, NUMELS[0] + 1)
