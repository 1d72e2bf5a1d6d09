"""NvmeStateTier's first state: the moments are never written (see [Note: moments never
written] in infinity/swap/nvme_state.py), yet read as zeros, pass the checksums, and the
state after steps is bitwise the host tier's."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from _engine_models import Zoo, batches, config, train_steps

import infinity
from infinity.config.sections import AioConfig
from infinity.io.aio import AioHandle
from infinity.io.aio_checks import available_backends
from infinity.optim.functional import adam_step_flat
from infinity.swap.nvme_state import NvmeStateTier, state_nbytes
from infinity.swap.state_tier import HostStateTier
from infinity.swap.store import align_up

NUMELS = [1000, 1, 3000, 0, 4096, 513]


def _masters(numels, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in numels]


def _scribble(store: NvmeStateTier) -> None:
    """Fill every extent on disk with garbage, as a reused file could hold: whatever the
    moments' pages hold must never be seen."""
    for i, n in enumerate(store.numels):
        ext = store.store.extent("optim", f"subgroup.{i}")
        fd = os.open(ext.path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x7f" * align_up(state_nbytes(n)), ext.offset)
        finally:
            os.close(fd)


@pytest.mark.parametrize("backend", available_backends())
def test_first_state_writes_the_masters_only_and_reads_zero_moments(swap, backend):
    aio = AioHandle(block_size=8192, queue_depth=4, backend=backend)
    masters = _masters(NUMELS)
    with aio, NvmeStateTier(NUMELS, store=swap, aio=aio, buffer_count=3) as s:
        _scribble(s)
        for i, m in enumerate(masters):
            s.initialize(i, m)
        s._drain()
        # Only the masters' pages went to disk: a third of the state, not all of it.
        assert s.stats.bytes_written == sum(align_up(4 * n) for n in NUMELS if n)
        for i, m in enumerate(masters):  # checksums on: the reads are checked
            got = s.read(i)
            assert torch.equal(got.master, m)
            assert not got.exp_avg.any() and not got.exp_avg_sq.any()
            n = NUMELS[i]
            assert not s.read_range(i, "exp_avg_sq", n // 3, n).any()
            assert torch.equal(s.read_range(i, "master", n // 3, n), m[n // 3 :])
        assert s.io.failed is None


@pytest.mark.parametrize("buffers", [3, 4])
def test_adam_from_a_sparse_first_state_is_bitwise_the_host_tiers(swap, buffers):
    """Three Adam steps (the first reads zero moments that were never written, on a disk
    holding garbage there), then a read of everything: the host tier's bits."""
    g = torch.Generator().manual_seed(3)
    grads = [[torch.randn(n, generator=g) for n in NUMELS] for _ in range(3)]
    aio = AioConfig(backend="posix", block_size=8192, queue_depth=4)
    nvme = NvmeStateTier(NUMELS, store=swap, aio=aio, buffer_count=buffers)
    _scribble(nvme)
    results = []
    for store in (HostStateTier(NUMELS), nvme):
        for i, m in enumerate(_masters(NUMELS, seed=4)):
            store.initialize(i, m)
        for step, step_grads in enumerate(grads, 1):
            for i, s in store.sweep():
                adam_step_flat(
                    s.master, step_grads[i], s.exp_avg, s.exp_avg_sq, step=step, lr=1e-2,
                    weight_decay=0.1, backend="torch",
                )  # fmt: skip
        results.append([store.read(i) for i in range(len(NUMELS))])
        store.close()
    for want, got in zip(*results, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert any(w.exp_avg.any() for w in results[1])  # the moments were stepped and written


def test_a_written_state_is_whole_again(swap):
    """`write` (a checkpoint load) replaces the moments too: they are read back, not zeroed."""
    aio = AioConfig(backend="posix")
    with NvmeStateTier([100, 200], store=swap, aio=aio, buffer_count=3) as s:
        s.initialize(0, torch.ones(100))
        s.initialize(1, torch.ones(200))
        state = s.read(1)
        state.exp_avg.fill_(2.0)
        state.exp_avg_sq.fill_(3.0)
        s.write(1, state)
        back = s.read(1)
        assert torch.equal(back.exp_avg, torch.full((200,), 2.0))
        assert torch.equal(s.read_range(1, "exp_avg_sq", 10, 20), torch.full((10,), 3.0))
        assert not s.read(0).exp_avg.any()


@pytest.mark.parametrize("saved_at", [0, 2], ids=["before-any-step", "after-two-steps"])
def test_resume_with_the_state_on_nvme_is_exact(tmp_path, saved_at):
    """A checkpoint taken while the moments were never written (before any step) or after
    steps, loaded into a fresh engine: the same losses and weights as going on."""
    torch.manual_seed(0)
    model = Zoo()
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "swap")}
    (tmp_path / "swap").mkdir()
    cfg = config(offload_optimizer=nvme, sub_group_size=300)
    data = batches(6, seed=21)
    engine = infinity.initialize(copy.deepcopy(model), cfg)
    train_steps(engine, data[:saved_at])
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = train_steps(engine, data[saved_at:])
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # everything must come from the checkpoint
    resumed = infinity.initialize(fresh, cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert train_steps(resumed, data[saved_at:]) == expected
    for (n, a), (_, b) in zip(
        engine.named_parameters_host(), resumed.named_parameters_host(), strict=True
    ):
        assert torch.equal(a, b), n
    engine.close()
    resumed.close()
