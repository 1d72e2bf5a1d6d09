"""New buffers on the CPU device reuse memory nothing refers to any more, and only that (see
[Note: recycled device buffers] in infinity/accelerator/recycled.py)."""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
from _engine_models import batches, config, tiny_gpt, train_steps

import infinity
from infinity.accelerator import CpuAccelerator, recycled
from infinity.accelerator.recycled import RecycledBuffers

MB = 1 << 20
SHAPE = (1024, 1024)  # 4 MiB of fp32: just at MIN_BYTES


def test_a_buffer_nothing_refers_to_is_handed_out_again():
    bufs = RecycledBuffers()
    a = bufs.empty(SHAPE, torch.float32)
    assert a.shape == SHAPE and a.dtype == torch.float32 and a.is_contiguous()
    ptr = a.data_ptr()
    del a
    b = bufs.empty(SHAPE, torch.float32)
    assert b.data_ptr() == ptr and bufs.reused == 1
    # Another dtype of the same size is the same memory too.
    del b
    c = bufs.empty((2048, 1024), torch.bfloat16)
    assert c.data_ptr() == ptr and c.dtype == torch.bfloat16 and bufs.reused == 2


@pytest.mark.parametrize("holder", ["view", "param_data", "saved_by_autograd", "numpy"])
def test_memory_still_referred_to_is_never_handed_out(holder):
    bufs = RecycledBuffers()
    a = bufs.empty(SHAPE, torch.float32).fill_(1.0)
    ptr = a.data_ptr()
    param = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # keeps `a` as .data
    x = torch.ones(3, SHAPE[0], requires_grad=True)
    if holder == "view":
        kept = a[5:].t()
    elif holder == "param_data":
        param.data = a.view(-1)
        kept = None
    elif holder == "saved_by_autograd":
        kept = (x @ a).sum()  # matmul saves `a` for x's gradient
    else:
        kept = a.numpy()
    del a
    gc.collect()
    b = bufs.empty(SHAPE, torch.float32)
    assert b.data_ptr() != ptr and bufs.reused == 0
    b.fill_(2.0)  # written while the first buffer is still readable through its holder
    if holder == "saved_by_autograd":
        kept.backward()
        # x.grad = 1 @ a.T, each element a row sum: of the 1s, not of the 2s
        assert torch.equal(x.grad, torch.full_like(x, SHAPE[1]))
    # Once the holder lets go, the memory comes back.
    del kept, param
    gc.collect()
    c = bufs.empty(SHAPE, torch.float32)
    assert c.data_ptr() == ptr and bufs.reused == 1


def test_small_buffers_are_allocated_as_usual():
    bufs = RecycledBuffers()
    small = bufs.empty((recycled.MIN_BYTES // 4 - 1,), torch.float32)
    assert bufs.kept_bytes == 0 and bufs.held_bytes == 0
    del small
    assert bufs.empty((10,), torch.float32).numel() == 10 and bufs.reused == 0


def test_what_is_kept_stays_within_the_peak_held_and_one_largest_buffer():
    bufs = RecycledBuffers()
    held = [bufs.empty((n * MB,), torch.uint8) for n in (4, 4, 4, 8)]
    assert bufs.held_bytes == bufs.peak_bytes == bufs.kept_bytes == 20 * MB
    del held
    assert bufs.held_bytes == 0 and bufs.kept_bytes == 20 * MB
    # New sizes: 12 fits in the limit (peak 20 + largest 12); with 16 held as well the peak
    # is 28 and the limit 44, so of the 20 MiB free one 4 MiB buffer (the smallest) goes.
    twelve = bufs.empty((12 * MB,), torch.uint8)
    assert bufs.kept_bytes == 32 * MB == bufs.limit_bytes
    sixteen = bufs.empty((16 * MB,), torch.uint8)
    assert bufs.peak_bytes == 28 * MB and bufs.limit_bytes == 44 * MB
    assert bufs.kept_bytes == 44 * MB  # 4 + 4 + 8 free, 12 + 16 held
    eight = bufs.empty((8 * MB,), torch.uint8)
    fours = [bufs.empty((4 * MB,), torch.uint8) for _ in range(2)]
    assert bufs.reused == 3 and bufs.kept_bytes == 44 * MB
    del twelve, sixteen, eight, fours
    bufs.clear()
    assert bufs.kept_bytes == 0 and bufs.peak_bytes == 0 and bufs.limit_bytes == 0


def test_a_buffer_let_go_on_another_thread_comes_back():
    bufs = RecycledBuffers()
    box = [bufs.empty(SHAPE, torch.float32)]
    ptr = box[0].data_ptr()
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()
    assert bufs.held_bytes == 0
    assert bufs.empty(SHAPE, torch.float32).data_ptr() == ptr


def test_to_device_on_the_cpu_copies_into_recycled_memory():
    accel = CpuAccelerator()
    src = torch.randn(SHAPE)
    first = accel.to_device(src)
    assert torch.equal(first, src) and first.data_ptr() != src.data_ptr()
    ptr = first.data_ptr()
    second = accel.to_device(src)
    assert second.data_ptr() != ptr  # the first is still held
    del first
    third = accel.to_device(src * 2)
    assert third.data_ptr() == ptr and torch.equal(third, src * 2)
    accel.empty_cache()
    assert accel.buffers.kept_bytes == 2 * src.nbytes  # what is held stays


@pytest.mark.parametrize("tier", ["nvme", "host-copied"])
def test_training_with_recycled_gathers_is_bitwise_the_same(tier, tmp_path, monkeypatch):
    """NVMe gathers (and, with aliasing off, host gathers) land in recycled buffers under a
    budget that releases and gathers again every layer: losses and weights are bitwise those
    of the same run allocating every buffer anew."""
    torch.manual_seed(0)
    model = tiny_gpt(layers=3, hidden=32)
    data = batches(4, seed=2)
    cfg = config(stage3_max_live_parameters=3000, stage3_max_reuse_distance=0)
    if tier == "nvme":
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    runs = {}
    for min_bytes in (1, 1 << 62):  # every buffer recycled, then none
        monkeypatch.setattr(recycled, "MIN_BYTES", min_bytes)
        accel = CpuAccelerator(alias_host=tier == "nvme")
        engine = infinity.initialize(copy.deepcopy(model), copy.deepcopy(cfg), accelerator=accel)
        losses = train_steps(engine, data)
        weights = {n: w.clone() for n, w in engine.named_parameters_host()}
        runs[min_bytes] = (losses, weights, accel.buffers.reused)
        engine.close()
    (l1, w1, reused), (l2, w2, none) = runs[1], runs[1 << 62]
    assert reused > 0 and none == 0
    assert l1 == l2
    assert all(torch.equal(w1[n], w2[n]) for n in w1)
