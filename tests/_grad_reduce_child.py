"""One rank of the gradient-reduction tests: prints a JSON line with what it checked."""

import json
import os
import sys

import torch

from infinity import comm
from infinity.accelerator import CpuAccelerator
from infinity.config import Config, RunFacts, resolve_run
from infinity.zero import PartitionedOptimizer, Slot
from infinity.zero.grad_reduce import GradReducer
from infinity.zero.shard import shard_of, take_shard

SIZES = [5, 7, 1, 300, 64, 3]


def grads_of(rank: int, micro: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return [torch.randn(n, generator=g).to(dtype) for n in SIZES]


def reduce(bucket: int, overlap: bool, contiguous: bool, half: bool) -> dict:
    """`half`: bf16 gradients reduced in fp32 buckets (communication_data_type "fp32"): the
    sums are then those of the bf16 values in fp32, exactly."""
    dtype = torch.bfloat16 if half else torch.float32
    c = comm.from_env(timeout=30)
    w, r = c.world_size, c.rank
    shards = [shard_of(n, w, r) for n in SIZES]
    slots = [torch.zeros(s.numel) for s in shards]

    def accumulate(i, g):
        slots[i].add_(g)

    reducer = GradReducer(
        c,
        accumulate,
        CpuAccelerator(),
        bucket_numel=bucket,
        overlap=overlap,
        contiguous=contiguous,
        total_shard_numel=sum(s.numel for s in shards),
        dtype=torch.float32 if half else None,
    )
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in SIZES]

    def hook(p, i):
        reducer.add(i, p.grad.reshape(-1))
        p.grad = None

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: hook(p, i))
    for micro in range(2):  # two backwards accumulate
        mine = grads_of(r, micro, dtype)
        loss = sum((p * g).sum() for p, g in zip(params, mine, strict=True))
        loss.backward()
    ok = True
    for i, (n, s) in enumerate(zip(SIZES, shards, strict=True)):
        want = torch.zeros(n)
        for micro in range(2):
            total = grads_of(0, micro, dtype)[i].float()
            for q in range(1, w):
                total += grads_of(q, micro, dtype)[i].float()
            want += total / w
        ok &= torch.equal(slots[i], take_shard(want, s))
    stats = c.stats()
    c.close()
    pooled = reducer.memory_stats()["grad_bucket_bytes"]
    shard_numels = [s.numel for s in shards]
    return {"equal": bool(ok), "buckets": reducer.buckets_issued, "stats": stats,
            "pooled": pooled, "shards": shard_numels}  # fmt: skip


def norm() -> dict:
    c = comm.from_env(timeout=30)
    w, r = c.world_size, c.rank
    shards = [shard_of(n, w, r) for n in SIZES]
    cfg = resolve_run(Config.from_dict({"optimizer": {"params": {"lr": 0.1}}}), RunFacts())
    slots = [
        Slot(name=f"p{i}", numel=s.numel, partition=torch.zeros(s.numel))
        for i, s in enumerate(shards)
    ]
    opt = PartitionedOptimizer(slots, optimizer=cfg.optimizer, zero=cfg.zero_optimization, comm=c)
    full = grads_of(7, 0)  # the same "reduced" gradient everywhere; each rank adds its shard
    for i, s in enumerate(shards):
        opt.accumulate_grad(i, take_shard(full[i], s))
    if r == 1 and len(sys.argv) > 2:
        opt.accumulate_grad(0, torch.full((shards[0].numel,), float("inf")))
    res = opt.step(lr=0.1, max_grad_norm=1.0)
    want = torch.cat(full).double().norm().item()
    c.close()
    return {"norm": res.grad_norm, "want": want, "overflow": res.overflow}


scenario = sys.argv[1]
if scenario == "reduce":
    b, o, ct, half = sys.argv[2:6]
    result = reduce(int(b), o == "1", ct == "1", half == "1")
else:
    result = norm()
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
