"""OffloadParam with a host home: state transitions, gathered buffers are copies (or, on the
CPU device by default, the home itself), .data swaps under autograd, the home's reads and
writes. The copy path runs on the CPU through `CpuAccelerator(alias_host=False)`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infinity.accelerator import CpuAccelerator
from infinity.zero import HomeTier, HostHome, OffloadParam, ParamState


def _record(shape=(3, 4), accel=None, *, alias=False):
    accel = accel or CpuAccelerator(alias_host=alias)
    param = nn.Parameter(torch.randn(shape))
    home = HostHome(param.detach().reshape(-1).clone(), name="w")
    rec = OffloadParam("w", param, home, device=accel.device)
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
    torch.testing.assert_close(rec.param.detach().cpu().reshape(-1), rec.home.flat)
    rec.release()
    assert rec.state is ParamState.RELEASED and rec.param.numel() == 0


def test_gathered_is_a_copy_when_the_device_does_not_alias():
    rec, accel = _record()
    rec.fetch(accel, accel.current_stream())
    rec.wait(accel)
    assert rec.param.data_ptr() != rec.home.flat.data_ptr()
    torch.testing.assert_close(rec.param.detach().reshape(-1), rec.home.flat)
    with torch.no_grad():
        rec.param.add_(1.0)  # the device copy changes, the home does not
    assert not torch.equal(rec.param.detach().reshape(-1), rec.home.flat)
    rec.home.flat.fill_(7.0)
    rec.refresh(accel)
    assert torch.all(rec.param == 7.0)


def test_gathered_aliases_its_host_home_on_the_cpu_device():
    rec, accel = _record(alias=True)
    before = accel.copies.host_to_device_bytes
    rec.fetch(accel, accel.current_stream())
    rec.wait(accel)
    flat = rec.home.flat
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.nbytes
    assert lo <= rec.param.data_ptr() < hi and rec.aliased
    assert accel.copies.host_to_device_bytes == before and accel.copies.seconds == 0
    rec.home.write(torch.arange(12.0))  # a write to the home is a write to the live buffer
    assert torch.equal(rec.param.detach().reshape(-1), torch.arange(12.0))
    rec.refresh(accel, torch.full((5,), 3.0), 4)  # the home was written first: no copy
    rec.refresh(accel)
    assert torch.equal(rec.param.detach().reshape(-1), torch.arange(12.0))
    assert accel.copies.host_to_device_bytes == before
    rec.release()
    assert not rec.aliased and rec.param.numel() == 0
    assert torch.equal(flat, torch.arange(12.0))  # releasing an alias keeps the home


def test_refresh_copies_given_values_into_a_range():
    rec, accel = _record()
    rec.fetch(accel, accel.current_stream())
    rec.wait(accel)
    before = rec.param.detach().clone().reshape(-1)
    rec.refresh(accel, torch.full((5,), 3.0), 4)
    got = rec.param.detach().reshape(-1)
    assert torch.all(got[4:9] == 3.0)
    assert torch.equal(got[:4], before[:4]) and torch.equal(got[9:], before[9:])


@pytest.mark.parametrize("alias", [False, True], ids=["copied", "aliased"])
def test_host_home_reads_and_writes_its_partition(alias):
    rec, accel = _record(alias=alias)
    assert rec.itemsize == 4 and rec.fetch(accel, accel.current_stream(), block=False)
    rec.wait(accel)
    assert rec.home.tier is HomeTier.HOST and rec.home.host_bytes == 48
    home = rec.home.read()
    assert torch.equal(home, rec.home.flat) and home.data_ptr() != rec.home.flat.data_ptr()
    rec.home.write(torch.arange(12.0).reshape(3, 4))
    assert torch.equal(rec.home.flat, torch.arange(12.0))
    # A copy is stale until refresh; an alias is the home.
    assert torch.equal(rec.param.detach().reshape(-1), rec.home.flat) is alias
    rec.refresh(accel)
    assert torch.equal(rec.param.detach().reshape(-1), rec.home.flat)


@pytest.mark.parametrize("alias", [False, True], ids=["copied", "aliased"])
def test_release_and_regather_between_forward_and_backward(alias):
    """Autograd keeps the leaf by reference: swapping .data keeps the version counter."""
    rec, accel = _record(alias=alias)
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


def test_home_shape_is_checked():
    param = nn.Parameter(torch.randn(2, 2))
    with pytest.raises(ValueError, match="flat host tensor"):
        HostHome(torch.zeros(2, 2), name="w")
    with pytest.raises(ValueError, match="holds 3 elements, the parameter has 4"):
        OffloadParam("w", param, HostHome(torch.zeros(3)), device=torch.device("cpu"))
    with pytest.raises(ValueError, match="5 elements, the home holds 4"):
        HostHome(torch.zeros(4)).write(torch.zeros(5))
