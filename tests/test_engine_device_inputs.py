"""Batches from a CPU data loader go straight into the engine on any device: the engine moves
tensor arguments to its device (nested in tuples, lists and dicts), and training on it gives
plain PyTorch's losses. On a GPU this is the first thing a real run does; the CPU device runs
the same body with its gathers aliased and copied."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_models import Zoo, batches, config

import infinity
from infinity.utils.batch import to_device as _to_device


def test_tensors_are_moved_and_the_structure_kept():
    ids = torch.arange(6).view(2, 3)
    x = torch.ones(2, dtype=torch.float32)
    out = _to_device(
        ((ids, [x, 3]), {"labels": ids, "mask": None}), torch.device("meta"), half=True
    )
    (moved_ids, (moved_x, three)), kw = out
    assert moved_ids.device.type == moved_x.device.type == kw["labels"].device.type == "meta"
    assert moved_ids.dtype == torch.int64 and moved_x.dtype == torch.float16  # ids stay ints
    assert three == 3 and kw["mask"] is None and isinstance(out[0][1], list)
    assert _to_device(x, torch.device("meta"), half=False).dtype == torch.float32


@pytest.mark.parametrize("steps", [3])
def test_cpu_batches_train_on_every_device_as_plain_pytorch(accel, steps):
    torch.manual_seed(0)
    model = Zoo()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    engine = infinity.initialize(model, config(), accelerator=accel)
    data = batches(steps)  # on the CPU, as a DataLoader yields them
    for ids in data:
        loss = engine(ids, labels=ids)  # labels as a keyword: kwargs move too
        assert loss.device == accel.device
        engine.backward(loss)
        engine.step()
        want = reference(ids, ids)
        want.backward()
        opt.step()
        opt.zero_grad()
        assert float(loss) == pytest.approx(float(want), rel=1e-4, abs=1e-5)
    engine.close()
