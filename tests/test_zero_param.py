"""OffloadParam: state transitions, gathered buffers are copies, .data swaps under autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infinity.accelerator import CpuAccelerator
from infinity.zero import HomeTier, OffloadParam, ParamState


def _record(shape=(3, 4), home=HomeTier.HOST, accel=None):
    accel = accel or CpuAccelerator()
    param = nn.Parameter(torch.randn(shape))
    part = param.detach().reshape(-1).clone()
    rec = OffloadParam("w", param, part, device=accel.device, home=home)
    rec.offload()
    return rec, accel


def test_states_and_guards(accel):
    rec, accel = _record(accel=accel)
    assert rec.state is ParamState.RELEASED and rec.param.numel() == 0
    with pytest.raises(RuntimeError, match="RELEASED"):
        rec.wait(accel)
    with pytest.raises(RuntimeError, match="RELEASED"):
        rec.release()
    rec.fetch(accel, accel.current_stream())
    assert rec.state is ParamState.INFLIGHT
    with pytest.raises(RuntimeError, match="INFLIGHT"):
        rec.fetch(accel, accel.current_stream())
    rec.wait(accel)
    assert rec.state is ParamState.LIVE and rec.param.shape == (3, 4)
    assert rec.param.device.type == accel.device.type
    torch.testing.assert_close(rec.param.detach().cpu().reshape(-1), rec.partition)
    rec.release()
    assert rec.state is ParamState.RELEASED and rec.param.numel() == 0


def test_gathered_is_a_copy_not_an_alias():
    rec, accel = _record()
    rec.fetch(accel, accel.current_stream())
    rec.wait(accel)
    assert rec.param.data_ptr() != rec.partition.data_ptr()
    torch.testing.assert_close(rec.param.detach().reshape(-1), rec.partition)
    with torch.no_grad():
        rec.param.add_(1.0)  # the device copy changes, the partition does not
    assert not torch.equal(rec.param.detach().reshape(-1), rec.partition)
    rec.partition.fill_(7.0)
    rec.refresh(accel)
    assert torch.all(rec.param == 7.0)


def test_nvme_home_needs_a_store_and_no_partition():
    with pytest.raises(ValueError, match="move_home_to_nvme"):
        _record(home=HomeTier.NVME)


def test_host_home_reads_and_writes_its_partition():
    rec, accel = _record()
    assert rec.itemsize == 4 and rec.fetch(accel, accel.current_stream(), block=False)
    rec.wait(accel)
    home = rec.read_home()
    assert torch.equal(home, rec.partition) and home.data_ptr() != rec.partition.data_ptr()
    rec.write_home(torch.arange(12.0).reshape(3, 4))
    assert torch.equal(rec.partition, torch.arange(12.0))
    assert not torch.equal(rec.param.detach().reshape(-1), rec.partition)  # until refresh
    rec.refresh(accel)
    assert torch.equal(rec.param.detach().reshape(-1), rec.partition)


def test_release_and_regather_between_forward_and_backward():
    """Autograd keeps the leaf by reference: swapping .data keeps the version counter."""
    rec, accel = _record()
    x = torch.randn(5, 4, requires_grad=True)
    rec.fetch(accel, accel.current_stream())
    rec.wait(accel)
    weight = rec.param.detach().clone()
    y = F.linear(x, rec.param)
    version = rec.param._version
    rec.release()
    rec.fetch(accel, accel.current_stream())
    rec.wait(accel)
    assert rec.param._version == version
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    w2 = weight.clone().requires_grad_()
    F.linear(x2, w2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(rec.param.grad, w2.grad)


def test_partition_shape_is_checked():
    param = nn.Parameter(torch.randn(2, 2))
    with pytest.raises(ValueError, match="1-D with 4 elements"):
        OffloadParam("w", param, torch.zeros(2, 2), device=torch.device("cpu"))
