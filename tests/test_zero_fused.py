"""A custom autograd Function that takes a parameter as an input and reads it inside (a fused
LM head, see [Note: fused kernels] in infinity/zero/hooks.py): bracketed by
begin/end_external_call it trains as plain PyTorch does under a tight live budget; without
the bracket autograd sees the released parameter."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _engine_models import VOCAB, batches, config, max_rel_diff, run_reference
from torch import nn

import infinity

HIDDEN = 16


class _Project(torch.autograd.Function):
    """`h @ w.T`, with `w` saved for the backward (as a fused head saves its weight)."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return h @ w.t()

    @staticmethod
    def backward(ctx, grad):
        h, w = ctx.saved_tensors
        return grad @ w, grad.flatten(0, -2).t() @ h.flatten(0, -2)


class FusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.hooks = None
        """The engine's hooks, to bracket the fused head with (None: unbracketed)."""

    def forward(self, ids, labels):
        h = torch.tanh(self.body(self.embed(ids)))
        call = self.hooks and self.hooks.begin_external_call([self.head.weight], (h,))
        loss = F.cross_entropy(_Project.apply(h, self.head.weight).flatten(0, 1), labels.flatten())
        if call:
            self.hooks.end_external_call(call, loss)
        return loss


def _engine(model):
    total = sum(p.numel() for p in model.parameters())
    # Room for the head (the largest unit) but not for everything: parameters are evicted.
    cfg = config(stage3_max_live_parameters=total // 2, stage3_prefetch_bucket_size=100)
    return infinity.initialize(copy.deepcopy(model), cfg)


def test_a_bracketed_fused_head_trains_as_plain_pytorch():
    torch.manual_seed(0)
    model = FusedHead()
    data = batches(4, seed=3)
    ref, _ = run_reference(model, data)
    engine = _engine(model)
    engine.module.hooks = engine.parts.hooks
    losses = []
    for ids in data:
        loss = engine(ids, ids)
        loss.backward()
        engine.step()
        losses.append(loss.item())
        assert not engine.parts.hooks.stack
        assert engine.memory_stats()["live_param_numel"] == 0
    assert max_rel_diff(losses, ref) < 1e-5
    engine.close()


def test_unbracketed_autograd_sees_the_released_parameter():
    torch.manual_seed(0)
    engine = _engine(FusedHead())
    ids = batches(1)[0]
    loss = engine(ids, ids)  # the forward's ops gather the weight as they read it ...
    with pytest.raises(RuntimeError, match="size|shape"):
        loss.backward()  # ... but the backward reads the parameter autograd saved: released
    engine.close()


class _Crossed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.hooks = None

    def forward(self, x):
        first = self.hooks.begin_external_call([self.a.weight], (x,))
        self.hooks.begin_external_call([self.b.weight], (x,))
        self.hooks.end_external_call(first, x)


def test_external_calls_end_in_reverse_order():
    engine = infinity.initialize(_Crossed(), config())
    engine.module.hooks = engine.parts.hooks
    with pytest.raises(RuntimeError, match="not the innermost running call"):
        engine(torch.ones(1, 2))
    engine.close()
