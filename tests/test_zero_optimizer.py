"""PartitionedOptimizer: parity with torch.optim.Adam/AdamW, dtypes, sub-groups, overflow,
checkpoints and bad input. Every parity test runs on both backends of the flat Adam step."""

from __future__ import annotations

import math

import pytest
import torch

from infinity.config import Config, OptimizerConfig, RunFacts, ZeroConfig, resolve_run
from infinity.optim import native_adam
from infinity.swap.state_tier import SubGroupState
from infinity.zero import PartitionedOptimizer, Slot, sub_group_numels

# Numels 407, 64, 105, 5000, 3, 258, 0, each slot on a 2048-element boundary: offsets 0,
# 2048, 4096, 6144, 12288, 14336, 16384 (total 16384). With sub_group_size=4096 the
# sub-groups are slots {0, 1}, {2, 3[:2048]}, {3[2048:]}, {4, 5, 6}: a slot split across two
# sub-groups, one sharing a sub-group with another slot.
SHAPES = [(37, 11), (64,), (5, 7, 3), (5000,), (3,), (129, 2), (0,)]
TOTAL = 16384
NUMEL = 5837
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
    """A StateTier that, like the NVMe tier, keeps nothing resident between uses: the sweep
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

    def sweep(self, order=None):
        for i in range(len(self.numels)) if order is None else order:
            state = self.read(i)
            yield i, state
            self.write(i, state)

    def read(self, index):
        self.reads.append(index)
        return SubGroupState(*(t.clone() for t in self._saved[index]))

    def write(self, index, state):
        self._saved[index] = SubGroupState(*(t.reshape(-1).clone() for t in state))

    def read_range(self, index, field, start, stop):
        self.reads.append((index, field, start, stop))
        return getattr(self._saved[index], field)[start:stop].clone()

    def close(self):
        pass

    def memory_stats(self):
        return {"optim_host_buffer_bytes": 12 * max(self.numels), "store_reads": len(self.reads)}


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


def make_opt(slots, *, sub_group_size=4096, store=None, no_decay=(), **cfg):
    optimizer = OptimizerConfig(**cfg)
    zero = ZeroConfig(sub_group_size=sub_group_size)
    if sub_group_size == "auto":  # the optimizer takes a resolved section
        zero = resolve_run(Config(zero_optimization=zero), RunFacts()).zero_optimization
    return PartitionedOptimizer(
        slots, optimizer=optimizer, zero=zero, state_tier=store, no_decay=no_decay
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
    sub_group_size = c.get("sub_group_size", 4096)
    store = None
    if store_cls is not None:
        store = store_cls(sub_group_numels(numels, ZeroConfig(sub_group_size=sub_group_size)))
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
        part = ours.home(i)
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
    stats = ours.memory_stats()
    assert stats["weights_bytes"] == TOTAL * DTYPES[dtype].itemsize
    assert stats["state_bytes"] == 12 * 4096  # the tier's own host buffers
    assert stats["store_reads"] > 0  # the tier's figures are passed on


def test_sub_groups_cut_the_flat_space_and_may_split_a_slot():
    opt = make_opt(make_slots())
    assert opt.layout.offsets == (0, 2048, 4096, 6144, 12288, 14336, 16384)
    assert opt.state_tier.numels == [4096] * 4
    assert opt.layout.pieces(1) == [(2, 0, 105), (3, 0, 2048)]
    assert opt.layout.pieces(2) == [(3, 2048, 5000)]
    assert list(opt.layout.sub_groups_of(3)) == [1, 2]
    assert make_opt(make_slots(), sub_group_size="auto").state_tier.numels == [TOTAL]
    # rounded up to a multiple of 2048 elements
    assert make_opt(make_slots(), sub_group_size=1).state_tier.numels == [2048] * 8
    assert make_opt(make_slots(), sub_group_size=5000).state_tier.numels == [6144, 6144, 4096]


def test_fp32_partitions_alias_the_host_masters(backend):
    slots = make_slots()
    opt = make_opt(slots, **backend)
    assert opt.aliased
    for i, slot in enumerate(slots):
        assert torch.equal(opt.home(i), slot.partition)  # initialised from the slot
        assert opt.home(i).data_ptr() != slot.partition.data_ptr() or not slot.numel
        opt.grad(i).fill_(1.0)
    opt.step(lr=0.1)
    state = masters(opt)
    for i, slot in enumerate(slots):
        assert torch.equal(opt.home(i), state[f"{slot.name}.master"])
    stats = opt.memory_stats()
    assert stats == {
        "numel": NUMEL,
        "grad_bytes": 4 * TOTAL,
        "weights_bytes": 0,
        "state_bytes": 12 * TOTAL,
        "host_bytes": 16 * TOTAL,
        "optim_state_bits": 32,
        "optim_overlap_bytes": 0,
        "optim_overlap_peak_bytes": 0,
    }  # fmt: skip  (no step began in a backward)


def test_half_memory_stats():
    opt = make_opt(make_slots(torch.bfloat16))
    assert opt.memory_stats()["grad_bytes"] == 0  # allocated at first use, see the class doc
    opt.grad(0)
    stats = opt.memory_stats()
    assert stats["weights_bytes"] == 2 * TOTAL
    assert stats["host_bytes"] == (4 + 2 + 12) * TOTAL


def test_no_slots_is_a_no_op():
    opt = make_opt([])
    assert opt.step(lr=1e-3) == (False, 0.0)
    assert opt.memory_stats()["host_bytes"] == 0


def test_without_bias_correction_matches_the_flat_reference(backend):
    from infinity.optim import adam_step_flat_reference

    slots = make_slots(shapes=[(300,), (77,)])
    opt = make_opt(slots, sub_group_size=100, bias_correction=False, weight_decay=0.1, **backend)
    ref = [(s.partition.clone(), torch.zeros(s.numel), torch.zeros(s.numel)) for s in slots]
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 6):
        for i, (p, m, v) in enumerate(ref):
            g = torch.randn(p.numel(), generator=gen)
            opt.grad(i).copy_(g)
            adam_step_flat_reference(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1,
                                     bias_correction=False)  # fmt: skip
        opt.step(lr=1e-2)
    state = masters(opt)
    for slot, (p, m, v) in zip(slots, ref, strict=True):
        assert_close_rel(state[f"{slot.name}.master"], p)
        assert_close_rel(state[f"{slot.name}.exp_avg"], m)
        assert_close_rel(state[f"{slot.name}.exp_avg_sq"], v)


# -- checkpoints ----------------------------------------------------------------------------
def _grad_sequence(steps, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [random_grads(gen, step, with_inf=step == 1) for step in range(steps)]


def _train(opt, grads):
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            opt.grad(i).add_(g * 64.0)
        opt.step(lr=3e-3, loss_scale=64.0, max_grad_norm=5.0)


def _assert_same(a, b):
    assert a.step_count == b.step_count
    for i in range(a.num_slots):
        assert torch.equal(a.home(i), b.home(i))
    sa, sb = masters(a), masters(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def _store_for(slots, store_cls):
    if store_cls is None:
        return None
    return store_cls(sub_group_numels([s.numel for s in slots], ZeroConfig(sub_group_size=4096)))


@pytest.mark.parametrize("store_cls", [None, CopyingStateStore], ids=["host", "copying"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_is_bitwise_identical(dtype, store_cls, backend):
    import json

    grads = _grad_sequence(6)
    dt = DTYPES[dtype]
    slots = make_slots(dt)
    straight = make_opt(slots, store=_store_for(slots, store_cls), **backend)
    _train(straight, grads)

    first = make_opt(slots, store=_store_for(slots, store_cls), **backend)
    _train(first, grads[:3])
    saved = {name: get().clone() for name, get in first.state_tensors()}
    meta = json.loads(json.dumps(first.state_dict()))

    other = make_slots(dt, seed=99)  # a fresh model: the masters come from the checkpoint
    resumed = make_opt(other, store=_store_for(other, store_cls), **backend)
    resumed.load_state_tensors(saved.__getitem__)
    resumed.load_state_dict(meta)
    assert resumed.step_count == first.step_count == 2  # one of the three steps overflowed
    _assert_same(first, resumed)
    _train(resumed, grads[3:])
    _assert_same(straight, resumed)


def test_resume_through_save_and_load_checkpoint(tmp_path, backend):
    from infinity.checkpoint import load_checkpoint, save_checkpoint

    grads = _grad_sequence(4)
    slots = make_slots(torch.float16)
    straight = make_opt(slots, **backend)
    _train(straight, grads)
    first = make_opt(slots, **backend)
    _train(first, grads[:2])
    save_checkpoint(tmp_path, first.state_tensors(), step=first.step_count,
                    state={"optimizer": first.state_dict()}, rng_state=None)  # fmt: skip
    ckpt = load_checkpoint(tmp_path)
    assert set(ckpt.tensor_names()) == {name for name, _ in first.state_tensors()}
    resumed = make_opt(make_slots(torch.float16, seed=7), **backend)
    resumed.load_state_tensors(ckpt.get_tensor)
    resumed.load_state_dict(ckpt.state["optimizer"])
    _train(resumed, grads[2:])
    _assert_same(straight, resumed)


def test_state_tensors_read_only_each_slots_share():
    slots = make_slots()
    store = CopyingStateStore([4096] * 4)
    opt = make_opt(slots, store=store)
    store.reads.clear()
    names = []
    for name, get in opt.state_tensors():
        assert get().numel() == slots[len(names) // 3].numel
        names.append(name)
    assert names[:3] == ["layer0.weight.master", "layer0.weight.exp_avg",
                         "layer0.weight.exp_avg_sq"]  # fmt: skip
    assert all(len(r) == 4 for r in store.reads)  # ranges only, never a whole sub-group
    assert sum(stop - start for _, _, start, stop in store.reads) == 3 * NUMEL
    # the split slot is read from both of its sub-groups
    assert (1, "master", 2048, 4096) in store.reads and (2, "master", 0, 2952) in store.reads


def test_a_different_sub_group_size_loads_the_same_state():
    grads = _grad_sequence(2)
    first = make_opt(make_slots())
    _train(first, grads)
    saved = {name: get().clone() for name, get in first.state_tensors()}
    other = make_opt(make_slots(seed=3), sub_group_size=64)
    other.load_state_tensors(saved.__getitem__)
    other.load_state_dict(first.state_dict())
    for name, get in other.state_tensors():
        assert torch.equal(get(), saved[name])


def test_loading_another_layout_names_the_first_mismatch():
    opt = make_opt(make_slots())
    d = opt.state_dict()
    d["slots"][2] = ["layer9.bias", 105]
    with pytest.raises(ValueError, match=r"slot 2 is 'layer9.bias'.*'layer2.weight'"):
        opt.load_state_dict(d)
    d = opt.state_dict()
    d["slots"].pop()
    with pytest.raises(ValueError, match="6 slots but this optimizer has 7"):
        opt.load_state_dict(d)
    saved = {name: get().clone() for name, get in opt.state_tensors()}
    del saved["layer3.weight.exp_avg"]
    with pytest.raises(ValueError, match=r"'layer3.weight.exp_avg' \(slot 3\)"):
        opt.load_state_tensors(saved.__getitem__)
    saved["layer3.weight.exp_avg"] = torch.zeros(4999)
    with pytest.raises(ValueError, match="has 4999 elements but slot 3 has 5000"):
        opt.load_state_tensors(saved.__getitem__)


# -- bad input ------------------------------------------------------------------------------
def _slot(name="w", t=None, numel=None):
    t = torch.zeros(6) if t is None else t
    return Slot(name, t.numel() if numel is None else numel, t)


@pytest.mark.parametrize(
    "slots,error,match",
    [
        ([_slot(t=torch.zeros(2, 3))], ValueError, r"slot 0 \('w'\).*shape \(2, 3\)"),
        ([_slot(t=torch.zeros(12)[::2])], ValueError, r"strides \(2,\); pass the flat"),
        ([_slot(t=torch.zeros(6, device="meta"))], ValueError, "on meta"),
        ([_slot(numel=5)], ValueError, "numel is 5 but the partition has 6"),
        ([_slot("a"), _slot("b"), _slot("a")], ValueError, "slot 2 .*slot 0's.*unique"),
        ([_slot(t=torch.zeros(6, dtype=torch.int64))], TypeError, "dtype torch.int64"),
        ([_slot("a"), _slot("b", torch.zeros(6).half())], TypeError, "slot 1 .*one model dtype"),
        ([_slot(name="")], ValueError, "non-empty name"),
        (["w"], TypeError, "Slot records"),
    ],
)
def test_bad_slots_are_named(slots, error, match):
    with pytest.raises(error, match=match):
        make_opt(slots)


def test_bad_settings_are_named():
    slots = [_slot()]
    with pytest.raises(ValueError, match="sub_group_size must be a positive int"):
        make_opt(slots, sub_group_size=0)
    with pytest.raises(ValueError, match=r"betas is 'auto'.*resolve"):
        make_opt(slots, betas="auto")
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        make_opt(slots, weight_decay=-1.0)
    with pytest.raises(ValueError, match="not slot indices"):
        make_opt(slots, no_decay={3})
    with pytest.raises(ValueError, match=r"holds sub-groups of \[5\].*\[2048\]"):
        make_opt(slots, store=CopyingStateStore([5]))
    opt = make_opt(slots)
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        opt.step(lr=-1e-3)
    with pytest.raises(ValueError, match="lr must be finite"):
        opt.step(lr=float("nan"))
    with pytest.raises(ValueError, match="loss_scale must be finite and > 0"):
        opt.step(lr=1e-3, loss_scale=0.0)
    with pytest.raises(ValueError, match="max_grad_norm must be >= 0"):
        opt.step(lr=1e-3, max_grad_norm=-1.0)
    with pytest.raises(TypeError, match="lr must be a real number"):
        opt.step(lr="1e-3")
    with pytest.raises(IndexError, match="slot 1 out of range"):
        opt.grad(1)
    assert opt.step(lr=0.0) == (False, 0.0)  # lr 0 is allowed, as in torch
    assert opt.step_count == 1


def test_benchmark_runs_at_tiny_size(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "zero_optimizer_bench.py"
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(script), "--numel", "300K", "--dtype", "fp32", "--dtype", "bf16"]
    cmd += ["--sub-group-size", "100K", "--warmup", "0", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(out.read_text())
    assert set(rec["results"]) == {"infinity-fp32", "infinity-bf16", "torch-fused",
                                   "torch-foreach"}  # fmt: skip
    ours = rec["results"]["infinity-bf16"]
    assert ours["ratio_to_torch-fused"] > 0
    padding = 2048 * rec["slots"]  # each slot starts on a 2048-element boundary
    assert 2 * 300_000 <= ours["memory"]["weights_bytes"] < 2 * (300_000 + padding)
    assert set(ours["breakdown_median_s"]) == {"norm_s", "adam_s", "zero_grad_s"}


@pytest.mark.parametrize("bad", ["inf-in-rows", "nan-in-tail", "-inf-first"])
def test_every_gradient_element_is_checked_for_overflow(bad):
    slots = make_slots(shapes=[(3 * 4096 + 5,), (7,)])
    opt = make_opt(slots, sub_group_size=1_000_000)
    before = opt.home(0).clone()
    position, value = {"inf-in-rows": (4100, "inf"), "nan-in-tail": (3 * 4096 + 2, "nan"),
                       "-inf-first": (0, "-inf")}[bad]  # fmt: skip
    opt.grad(0).fill_(1e-3)
    opt.grad(0)[position] = float(value)
    result = opt.step(lr=1.0)
    assert result.overflow
    assert opt.step_count == 0
    assert torch.equal(opt.home(0), before)
    assert not opt.grad(0).any()


def test_grad_norm_is_accurate_for_large_sub_groups():
    n = (1 << 24) + 7  # a single fp32 reduction over this many elements drifts by ~1e-3
    slots = [Slot("big", n, torch.zeros(n)), Slot("small", 3, torch.zeros(3))]
    opt = make_opt(slots, sub_group_size="auto")
    gen = torch.Generator().manual_seed(0)
    opt.grad(0).copy_(torch.randn(n, generator=gen) * 3 + 1)
    opt.grad(1).copy_(torch.tensor([1e3, -2e3, 5.0]))
    exact = math.sqrt(sum(opt.grad(i).double().square().sum().item() for i in range(2)))
    result = opt.step(lr=0.0)
    assert result.grad_norm == pytest.approx(exact, rel=1e-7)


@pytest.mark.parametrize("store_cls", [None, CopyingStateStore], ids=["host", "copying"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_refresh_masters_takes_weights_written_into_the_partitions(dtype, store_cls):
    slots = make_slots(DTYPES[dtype])
    opt = make_opt(slots, store=_store_for(slots, store_cls))
    for i in range(opt.num_slots):
        opt.grad(i).fill_(1.0)
    opt.step(lr=1e-2)
    moments = {k: v for k, v in masters(opt).items() if not k.endswith(".master")}
    new = make_slots(DTYPES[dtype], seed=11)
    for i, slot in enumerate(new):
        opt.home(i).copy_(slot.partition)
    opt.refresh_masters()
    state = masters(opt)
    for i, slot in enumerate(new):
        assert torch.equal(state[f"{slot.name}.master"], slot.partition.float())
        assert torch.equal(opt.home(i), slot.partition)
    for k, v in moments.items():
        assert torch.equal(state[k], v)


def test_partitions_that_require_grad_are_copied_without_autograd():
    slots = [Slot(s.name, s.numel, torch.nn.Parameter(s.partition)) for s in make_slots()]
    for store in (None, CopyingStateStore([4096] * 4)):
        opt = make_opt(slots, store=store)
        assert not any(opt.home(i).requires_grad for i in range(opt.num_slots))
        assert not any(t.requires_grad for _, t in masters(opt).items())
        opt.grad(0).fill_(1.0)
        opt.step(lr=1e-3)


def test_changed_hyperparameters_are_logged_and_the_config_wins(caplog):
    opt = make_opt(make_slots(), weight_decay=0.1)
    d = opt.state_dict()
    d["hyperparameters"]["weight_decay"] = 0.0
    d["step_count"] = 7
    with caplog.at_level("WARNING", logger="infinity.zero.optimizer"):
        opt.load_state_dict(d)
    assert "weight_decay was 0.0 in the checkpoint and is 0.1 now" in caplog.text
    assert opt.hyper.weight_decay == 0.1
    assert opt.step_count == 7


def _nvme_store_factory(tmp_path):
    """NvmeStateTier over a fresh swap directory per store (skips where the tier is absent)."""
    nvme_state = pytest.importorskip("infinity.swap.nvme_state")
    swap_store = pytest.importorskip("infinity.swap.store")
    from infinity.config import AioConfig

    made = []

    def factory(numels):
        path = tmp_path / f"swap{len(made)}"
        path.mkdir()
        swap = swap_store.SwapStore(path, run_id="t")
        store = nvme_state.NvmeStateTier(numels, store=swap, aio=AioConfig(backend="posix"),
                                          buffer_count=3)  # fmt: skip
        made.append((store, swap))
        return store

    return factory, made


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_nvme_tier_trains_and_resumes_like_the_host_tier(tmp_path, dtype, backend):
    factory, made = _nvme_store_factory(tmp_path)
    try:
        run_parity("loss-scale-clip", backend, dtype=DTYPES[dtype], store_cls=factory)
        grads = _grad_sequence(6)
        slots = make_slots(DTYPES[dtype])
        straight = make_opt(slots, **backend)
        _train(straight, grads)
        first = make_opt(slots, store=_store_for(slots, factory), **backend)
        _train(first, grads[:3])
        saved = {name: get().clone() for name, get in first.state_tensors()}
        other = make_slots(DTYPES[dtype], seed=4)
        resumed = make_opt(other, store=_store_for(other, factory), **backend)
        resumed.load_state_tensors(saved.__getitem__)
        resumed.load_state_dict(first.state_dict())
        _train(resumed, grads[3:])
        _assert_same(straight, resumed)
    finally:
        for store, swap in made:
            store.close()
            swap.close()
