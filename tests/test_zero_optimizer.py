"""PartitionedOptimizer: parity with torch.optim.Adam/AdamW, dtypes, sub-groups, overflow,
checkpoints and bad input. Every parity test runs on both backends of the flat Adam step."""

from __future__ import annotations

import math

import pytest
import torch

from infinity.config import OptimizerConfig, ZeroConfig
from infinity.optim import native_adam
from infinity.swap.state_store import SubGroupState
from infinity.zero import PartitionedOptimizer, Slot

# Numels 407, 64, 105, 1000, 3, 258, 0: with sub_group_size=500 they pack into
# [407, 64] [105] [1000] [3, 258, 0]: a slot larger than a sub-group, boundaries mid-list.
SHAPES = [(37, 11), (64,), (5, 7, 3), (1000,), (3,), (129, 2), (0,)]
STEPS = 8
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(params=["torch", "native"])
def backend(request, monkeypatch):
    """Yields OptimizerConfig keywords choosing the backend of adam_step_flat."""
    if request.param == "native":
        if not native_adam.available():
            pytest.skip("infinity._cpu_adam is not built")
        monkeypatch.setenv("INFINITY_ADAM_BACKEND", "native")
        return {"torch_adam": False}
    return {"torch_adam": True}


class CopyingStateStore:
    """A StateStore that, like the NVMe tier, keeps nothing resident between uses: the sweep
    hands out copies and writes each back when the caller moves on."""

    def __init__(self, numels):
        self.numels = list(numels)
        self._saved = [None] * len(self.numels)
        self.reads = []

    def initialize(self, index, master):
        n = self.numels[index]
        self._saved[index] = SubGroupState(
            master.reshape(-1).to(torch.float32, copy=True), torch.zeros(n), torch.zeros(n)
        )

    def sweep(self):
        for i in range(len(self.numels)):
            state = self.read(i)
            yield i, state
            self.write(i, state)

    def read(self, index):
        self.reads.append(index)
        return SubGroupState(*(t.clone() for t in self._saved[index]))

    def write(self, index, state):
        self._saved[index] = SubGroupState(*(t.reshape(-1).clone() for t in state))

    def close(self):
        pass


def assert_close_rel(actual, expected, rel=1e-6):
    """Equal within `rel` of the tensor's scale (elementwise error / max |expected|)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


def make_slots(dtype=torch.float32, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [
        Slot(f"layer{i}.weight", math.prod(s), torch.randn(math.prod(s), generator=gen).to(dtype))
        for i, s in enumerate(shapes)
    ]


def make_opt(slots, *, sub_group_size=500, store=None, no_decay=(), **cfg):
    optimizer = OptimizerConfig(**cfg)
    zero = ZeroConfig(sub_group_size=sub_group_size)
    return PartitionedOptimizer(
        slots, optimizer=optimizer, zero=zero, state_store=store, no_decay=no_decay
    )


def masters(opt):
    """{"<slot>.<field>": tensor} with every thunk evaluated."""
    return {name: get().clone() for name, get in opt.state_tensors()}


def random_grads(gen, step, with_inf=False):
    grads = [torch.randn(math.prod(s), generator=gen) * (1 + step) for s in SHAPES]
    if with_inf:
        grads[3][17] = float("inf") if step % 2 else float("nan")
    return grads


CASES = {
    "adamw": dict(cfg=dict(type="AdamW", weight_decay=0.0)),
    "adamw-wd": dict(cfg=dict(type="AdamW", weight_decay=0.1)),
    "adam-l2": dict(cfg=dict(type="Adam", adam_w_mode=False, weight_decay=0.1)),
    "clip": dict(cfg=dict(weight_decay=0.05), clip=0.3),
    "loss-scale-clip": dict(cfg=dict(weight_decay=0.05), loss_scale=1024.0, clip=0.3),
    "overflow": dict(cfg=dict(weight_decay=0.05), loss_scale=256.0, overflow_at={2, 5}),
    "one-group": dict(cfg=dict(weight_decay=0.05), sub_group_size="auto", clip=2.0),
    "no-decay": dict(cfg=dict(weight_decay=0.1), no_decay={1, 4}),
}


def run_parity(case, backend, dtype=torch.float32, store_cls=None):
    """Trains ours and torch's side by side; checks every step's norm and the final state."""
    c = CASES[case]
    loss_scale, clip = c.get("loss_scale", 1.0), c.get("clip", 0.0)
    cfg = dict(c["cfg"], **backend)
    slots = make_slots(dtype)
    numels = [s.numel for s in slots]
    sub_group_size = c.get("sub_group_size", 500)
    store = None
    if store_cls is not None:
        size = 1_000_000_000 if sub_group_size == "auto" else sub_group_size
        from infinity.zero.sub_groups import pack

        store = store_cls([g.numel for g in pack(numels, size)])
    ours = make_opt(slots, sub_group_size=sub_group_size, store=store,
                    no_decay=c.get("no_decay", ()), **cfg)  # fmt: skip
    peers = [s.partition.float().reshape(shape).clone().requires_grad_()
             for s, shape in zip(slots, SHAPES, strict=True)]  # fmt: skip
    wd = cfg.get("weight_decay", 0.0)
    no_decay = c.get("no_decay", set())
    groups = [
        {"params": [p for i, p in enumerate(peers) if i not in no_decay], "weight_decay": wd},
        {"params": [p for i, p in enumerate(peers) if i in no_decay], "weight_decay": 0.0},
    ]
    adamw = cfg.get("type", "AdamW") == "AdamW" or cfg.get("adam_w_mode", True)
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    torch_opt = torch_cls(groups, lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    applied = 0
    for step in range(STEPS):
        overflow = step in c.get("overflow_at", ())
        grads = random_grads(gen, step, with_inf=overflow)
        lr = 1e-2 * (step + 1) / STEPS
        for i, g in enumerate(grads):  # two micro-batches, as the engine's hooks would add
            ours.grad(i).add_(g * (loss_scale / 2))
            ours.grad(i).add_(g * (loss_scale / 2))
        result = ours.step(lr=lr, loss_scale=loss_scale, max_grad_norm=clip)
        assert all(not ours.grad(i).any() for i in range(len(slots)))
        assert result.overflow == overflow
        if overflow:
            assert not math.isfinite(result.grad_norm)
            assert ours.step_count == applied
            continue
        applied += 1
        for p, g in zip(peers, grads, strict=True):
            p.grad = g.reshape(p.shape).clone()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(peers, clip, foreach=False)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in peers])
        assert result.grad_norm == pytest.approx(norm.item(), rel=1e-6)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
    assert ours.step_count == applied
    state = masters(ours)
    for i, (slot, peer) in enumerate(zip(slots, peers, strict=True)):
        expected = peer.detach().reshape(-1)
        assert_close_rel(state[f"{slot.name}.master"], expected)
        part = ours.partition(i)
        assert part.dtype == dtype
        if dtype == torch.float32:
            assert_close_rel(part, expected)
        else:  # the fused copy-out: the master rounded to nearest-even
            assert torch.equal(part, state[f"{slot.name}.master"].to(dtype))
        if slot.numel:
            peer_state = torch_opt.state[peer]
            assert_close_rel(state[f"{slot.name}.exp_avg"], peer_state["exp_avg"].reshape(-1))
            assert_close_rel(state[f"{slot.name}.exp_avg_sq"],
                             peer_state["exp_avg_sq"].reshape(-1))  # fmt: skip
            assert not torch.equal(part, slot.partition)  # it trained
    return ours


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_matches_torch_optim(case, backend):
    run_parity(case, backend)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", ["adamw-wd", "loss-scale-clip", "overflow"])
def test_half_models_match_torch_on_the_master(case, dtype, backend):
    run_parity(case, backend, dtype=DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", ["adamw-wd", "overflow"])
def test_a_non_resident_store_works_through_the_protocol(case, dtype, backend):
    ours = run_parity(case, backend, dtype=DTYPES[dtype], store_cls=CopyingStateStore)
    assert not ours.aliased
    assert ours.memory_stats()["partition_bytes"] == 1837 * DTYPES[dtype].itemsize


def test_sub_groups_pack_in_order():
    opt = make_opt(make_slots())
    assert opt.store.numels == [471, 105, 1000, 261]
    assert make_opt(make_slots(), sub_group_size="auto").store.numels == [1837]
    assert make_opt(make_slots(), sub_group_size=1).store.numels == [407, 64, 105, 1000, 3, 258]


def test_fp32_partitions_alias_the_host_masters(backend):
    slots = make_slots()
    opt = make_opt(slots, **backend)
    assert opt.aliased
    for i, slot in enumerate(slots):
        assert torch.equal(opt.partition(i), slot.partition)  # initialised from the slot
        assert opt.partition(i).data_ptr() != slot.partition.data_ptr() or not slot.numel
        opt.grad(i).fill_(1.0)
    opt.step(lr=0.1)
    state = masters(opt)
    for i, slot in enumerate(slots):
        assert torch.equal(opt.partition(i), state[f"{slot.name}.master"])
    stats = opt.memory_stats()
    assert stats == {"numel": 1837, "grad_bytes": 4 * 1837, "partition_bytes": 0,
                     "state_bytes": 12 * 1837, "host_bytes": 16 * 1837}  # fmt: skip


def test_half_memory_stats():
    stats = make_opt(make_slots(torch.bfloat16)).memory_stats()
    assert stats["partition_bytes"] == 2 * 1837
    assert stats["host_bytes"] == (4 + 2 + 12) * 1837


def test_no_slots_is_a_no_op():
    opt = make_opt([])
    assert opt.step(lr=1e-3) == (False, 0.0)
    assert opt.memory_stats()["host_bytes"] == 0
