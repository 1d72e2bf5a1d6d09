"""Gradient sums on NVMe: bitwise those of the host buffer whatever the order of the adds,
host memory bounded by the buffer count, overflow seen in spilled sub-groups, clear errors,
and through the engine: accumulation over micro-steps bitwise equal to the host path."""

from __future__ import annotations

import math
import time

import pytest
import torch
from _engine_models import batches, run_engine, tiny_gpt
from test_engine_nvme import _cfg

from infinity.config.sections import AioConfig
from infinity.swap.grad_tier import HostGradTier, NvmeGradError, NvmeGradTier
from infinity.swap.store import SwapStore
from infinity.utils.exact_sum import ExactSum

AIO = AioConfig(backend="posix", block_size=1 << 16, queue_depth=4)
NUMELS = [4096, 4096, 2048, 4096, 6144, 2048]


def _adds(seed: int, micro_steps: int):
    """(sub-group, start, values) in a shuffled order, several adds per sub-group."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro_steps):
        step = []
        for g, n in enumerate(NUMELS):
            for start in range(0, n, 1024):
                step.append((g, start, torch.randn(1024, generator=gen)))
        order = torch.randperm(len(step), generator=gen).tolist()
        out.extend(step[i] for i in order)
    return out


@pytest.mark.parametrize("buffer_count", [2, 3, 5])
def test_spilled_sums_are_bitwise_the_host_ones(tmp_path, buffer_count):
    host = HostGradTier(NUMELS)
    with SwapStore(str(tmp_path), run_id="t") as store:
        nvme = NvmeGradTier(NUMELS, store=store, aio=AIO, buffer_count=buffer_count)
        for g, start, values in _adds(0, micro_steps=3):
            host.add(g, start, values)
            nvme.add(g, start, values)
        got, want = nvme.sums_of_squares(), host.sums_of_squares()
        assert got == want  # exact sums: equal bins, not only equal values
        for g in range(len(NUMELS)):
            assert torch.equal(nvme.take(g), host.take(g)), g
            nvme.release(g)
        stats = nvme.memory_stats()
        assert stats["nvme_grad_bytes_written"] > 0 and stats["nvme_grad_bytes_read"] > 0
        # The host holds buffer_count sub-groups at most, not the whole gradient.
        assert stats["grad_host_bytes"] == min(buffer_count, len(NUMELS) + 1) * 6144 * 4
        assert nvme.sums_of_squares() == [ExactSum()] * len(NUMELS)  # released: no reads
        nvme.close()


def test_a_second_window_starts_from_zero(tmp_path):
    with SwapStore(str(tmp_path), run_id="t") as store:
        nvme = NvmeGradTier(NUMELS, store=store, aio=AIO, buffer_count=2)
        for g, start, values in _adds(1, micro_steps=1):
            nvme.add(g, start, values)
        nvme.zero()  # a skipped step
        read = nvme.memory_stats()["nvme_grad_bytes_read"]
        nvme.add(5, 0, torch.ones(8))
        for g in range(len(NUMELS)):
            grad = nvme.take(g)
            assert grad[:8].tolist() == ([1.0] * 8 if g == 5 else [0.0] * 8), g
            assert grad[8:].count_nonzero() == 0, g
            nvme.release(g)
        assert nvme.memory_stats()["nvme_grad_bytes_read"] == read  # zeros need no reads
        nvme.close()


def test_overflow_in_a_spilled_sub_group_reaches_the_norm(tmp_path):
    with SwapStore(str(tmp_path), run_id="t") as store:
        nvme = NvmeGradTier(NUMELS, store=store, aio=AIO, buffer_count=2)
        nvme.add(0, 7, torch.tensor([float("inf")]))
        for g in range(1, len(NUMELS)):  # pushes sub-group 0 out to disk
            nvme.add(g, 0, torch.ones(4))
        assert nvme.residency[0].name == "ON_NVME"
        assert math.isinf(float(sum(nvme.sums_of_squares(), ExactSum())))
        nvme.close()


def test_a_failed_write_names_the_file_and_refuses_further_use(tmp_path, monkeypatch):
    with SwapStore(str(tmp_path), run_id="t") as store:
        nvme = NvmeGradTier(NUMELS, store=store, aio=AIO, buffer_count=2)

        def refuse(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(nvme.aio, "pwrite", refuse)
        with pytest.raises(NvmeGradError, match=r"write of gradients .*grad.*No space left"):
            for g in range(len(NUMELS)):
                nvme.add(g, 0, torch.ones(4))
        with pytest.raises(NvmeGradError, match="refused"):
            nvme.add(0, 0, torch.ones(4))
        nvme.close()


def test_too_few_buffers_is_a_clear_error(tmp_path):
    store = SwapStore(str(tmp_path), run_id="t")
    with store, pytest.raises(ValueError, match="at least 2 host buffers"):
        NvmeGradTier(NUMELS, store=store, aio=AIO, buffer_count=1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_engine_accumulation_with_spilled_gradients_is_bitwise_the_host_path(tmp_path, dtype):
    torch.manual_seed(0)
    model = tiny_gpt(checkpointing=False)
    data = batches(6, seed=5)
    cpu, nvme = _cfg(tmp_path / "unused", "cpu", dtype), _cfg(tmp_path, "nvme", dtype)
    for cfg in (cpu, nvme):
        cfg["gradient_accumulation_steps"] = 3  # read-add-write across micro-steps
    ref_losses, ref = run_engine(model, data, cpu)
    got_losses, got = run_engine(model, data, nvme)
    assert got_losses == ref_losses
    assert got.get_global_grad_norm() == ref.get_global_grad_norm()
    for (name, a), (_, b) in zip(
        got.named_parameters_host(), ref.named_parameters_host(), strict=True
    ):
        assert torch.equal(a, b), name
    stats = got.memory_stats()
    numel = sum(r.numel for r in got.parts.records if r.trainable)
    assert stats["nvme_grad_bytes_written"] > 0 and stats["nvme_grad_bytes_read"] > 0
    assert stats["grad_bytes"] < 4 * numel  # a few sub-groups, not the whole gradient
    assert ref.memory_stats()["grad_bytes"] >= 4 * numel
    got.close()
    ref.close()


def test_small_adds_to_spilled_sub_groups_update_only_their_rows(tmp_path):
    numels = [65536, 68608]  # the second ends in a short row (33.5 rows of 2048)
    gen = torch.Generator().manual_seed(2)
    big = [torch.randn(n, generator=gen) for n in numels]
    small = [(g, start, torch.randn(100, generator=gen)) for g, start in
             ((0, 0), (0, 40_000), (1, 4090), (1, 67_484), (0, 65_436), (1, 65_530))]  # fmt: skip
    host = HostGradTier(numels)
    with SwapStore(str(tmp_path), run_id="t") as store:
        nvme = NvmeGradTier(numels, store=store, aio=AIO, buffer_count=2)
        for g in (0, 1, 0, 1):  # each written out by the other's add
            host.add(g, 0, big[g])
            nvme.add(g, 0, big[g])
        nvme.add(0, 0, torch.zeros(numels[0]))  # sub-group 1 goes to disk too
        host.add(0, 0, torch.zeros(numels[0]))
        assert nvme.residency[1].name == "ON_NVME"
        written = nvme.memory_stats()["nvme_grad_bytes_written"]
        for g, start, values in small:
            host.add(g, start, values)
            nvme.add(g, start, values)
        # Each small add to sub-group 1 moved a row or two, not the sub-group.
        assert nvme.memory_stats()["nvme_grad_bytes_written"] - written < 4 * 4 * 4096 * 2
        assert nvme.sums_of_squares() == host.sums_of_squares()
        for g in range(2):
            assert torch.equal(nvme.take(g), host.take(g)), g
            nvme.release(g)
        nvme.close()


def test_later_micro_steps_read_the_next_sub_group_down_ahead(tmp_path):
    host = HostGradTier(NUMELS)
    with SwapStore(str(tmp_path), run_id="t") as store:
        nvme = NvmeGradTier(NUMELS, store=store, aio=AIO, buffer_count=3)
        ahead = []
        for _ in range(3):  # micro-steps, each going down the sub-groups as backward does
            for g in reversed(range(len(NUMELS))):
                values = torch.full((NUMELS[g],), float(g + 1))
                host.add(g, 0, values)
                nvme.add(g, 0, values)
                time.sleep(0.05)  # the layer's compute: the write started at this add lands
                nvme.add(g, 0, values)
                host.add(g, 0, values)
                ahead.append(g > 0 and nvme.residency[g - 1].name == "READING")
        assert not any(ahead[: len(NUMELS)])  # the first micro-step has nothing on disk
        assert sum(ahead[len(NUMELS) :]) >= len(NUMELS)  # later ones mostly read ahead
        assert nvme.sums_of_squares() == host.sums_of_squares()
        for g in range(len(NUMELS)):
            assert torch.equal(nvme.take(g), host.take(g)), g
            nvme.release(g)
        nvme.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_large_16_bit_gradient_is_added_in_pieces_to_the_same_bits(dtype):
    """`add_into` adds a 16-bit gradient longer than a piece one piece at a time (no
    gradient-sized fp32 temporary); the sums are bitwise those of one `add_`, odd tail
    included, and short or fp32 sources take the one call."""
    from infinity.swap.grad_tier import _ADD_CHUNK_NUMEL, add_into

    g = torch.Generator().manual_seed(0)
    n = 3 * _ADD_CHUNK_NUMEL + 77
    src = torch.randn(n, generator=g).to(dtype)
    base = torch.randn(n, generator=g)
    whole, pieces = base.clone(), base.clone()
    whole.add_(src)
    add_into(pieces, src)
    assert torch.equal(whole, pieces)
    host = HostGradTier([n, 10])
    host.add(0, 0, src)
    host.add(0, 0, src)
    assert torch.equal(host.take(0), src.float() + src.float())
