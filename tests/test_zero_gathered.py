"""GatheredIndex: a tensor is matched to the gathered parameter whose memory it lies in, for
copied buffers (by storage) and for aliases sharing one flat buffer (by address range)."""

from __future__ import annotations

import torch
from torch import nn

from infinity.accelerator import CpuAccelerator
from infinity.zero import HostHome, OffloadParam
from infinity.zero.gathered import GatheredIndex
from infinity.zero.hooks import ModelHooks


def _records(accel, shapes):
    flat = torch.arange(float(sum(torch.Size(s).numel() for s in shapes)))
    recs, at = [], 0
    for i, shape in enumerate(shapes):
        n = torch.Size(shape).numel()
        param = nn.Parameter(torch.empty(shape))
        rec = OffloadParam(f"p{i}", param, HostHome(flat[at : at + n]), device=accel.device)
        rec.offload()
        rec.fetch(accel, accel.current_stream())
        rec.wait(accel)
        recs.append(rec)
        at += n
    return flat, recs


def test_aliases_in_one_flat_buffer_are_found_by_address():
    flat, recs = _records(CpuAccelerator(), [(3, 4), (0,), (5,), (2, 3)])
    index = GatheredIndex()
    assert not index
    for rec in recs:
        index.add(rec)
    a, empty, b, c = recs
    assert all(r.aliased for r in recs)
    assert index.find(a.param.t()) is a and index.find(a.param[2, 1:]) is a
    assert index.find(b.param[4:]) is b and index.find(c.param.t()[1]) is c
    assert index.find(torch.zeros(3)) is None
    index.remove(b)
    assert index.find(b.param) is None and index.find(c.param) is c
    for rec in (a, empty, c):
        index.remove(rec)
    assert not index


def test_copied_buffers_are_found_by_storage():
    _, recs = _records(CpuAccelerator(alias_host=False), [(3, 4), (5,)])
    index = GatheredIndex()
    for rec in recs:
        index.add(rec)
    assert not any(r.aliased for r in recs)
    assert index.find(recs[0].param[1:].t()) is recs[0] and index.find(recs[1].param) is recs[1]
    index.remove(recs[0])
    assert index.find(recs[0].param) is None


def test_a_saved_view_with_an_offset_is_rebuilt_from_its_parameter():
    """Packed relative to the parameter's own offset in the shared buffer, rebuilt from it."""
    flat, recs = _records(CpuAccelerator(), [(3, 4), (2, 5)])
    hooks = ModelHooks.__new__(ModelHooks)
    hooks.coord = type("C", (), {"gathered": GatheredIndex()})()
    for rec in recs:
        hooks.coord.gathered.add(rec)
    view = recs[1].param[1, 2:]
    saved = hooks._pack(view)
    assert saved.rec is recs[1] and saved.offset == 7
    assert torch.equal(hooks._unpack(saved), view)
