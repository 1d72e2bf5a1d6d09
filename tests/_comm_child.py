"""One rank of the comm tests: runs a scenario and prints a JSON line with what it saw."""

import json
import os
import sys
import time

import torch

from infinity import comm
from infinity.comm import torch_dist

scenario = sys.argv[1]


def spy_on_transport() -> list[torch.Tensor]:
    """The output tensor of each collective the transport is handed, kept alive (so their
    storages can be compared with the callers')."""
    handed: list[torch.Tensor] = []

    def spy(fn):
        def call(out, *args, **kwargs):
            handed.append(out)
            return fn(out, *args, **kwargs)

        return call

    torch_dist._ALL_GATHER = spy(torch_dist._ALL_GATHER)
    torch_dist._REDUCE_SCATTER = spy(torch_dist._REDUCE_SCATTER)
    torch_dist.dist.all_reduce = spy(torch_dist.dist.all_reduce)
    return handed


def collectives() -> dict:
    device = torch.device(os.environ.get("COMM_TEST_DEVICE", "cpu"))
    if device.type == "cuda":  # NCCL: one device per local rank
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    c = comm.from_env(timeout=20, device=device)
    handed = spy_on_transport()
    if os.environ.get("COMM_TEST_STAGE"):  # as on a group without a backend for CPU tensors
        c._stage = device
    r, w = c.rank, c.world_size
    out: dict = {"rank": r, "world_size": w, "local_rank": c.local_rank}
    shard = torch.arange(3, dtype=torch.float32, device=device) + 10 * r
    full = torch.empty(3 * w, device=device)
    c.all_gather_into(full, shard)
    out["all_gather"] = full.tolist()
    half = torch.empty(3 * w, dtype=torch.bfloat16, device=device)
    work = c.all_gather_into(half, shard.bfloat16(), async_op=True)
    work.wait()
    out["all_gather_bf16"] = half.float().tolist()
    flat = torch.arange(4 * w, dtype=torch.float32, device=device) * (r + 1)
    mine = torch.empty(4, device=device)
    c.reduce_scatter_into(mine, flat, async_op=True).wait()
    out["reduce_scatter"] = mine.tolist()
    summed = c.all_reduce_(torch.tensor([1.0, r], device=device))
    out["all_reduce_sum"] = summed.tolist()
    maxed = c.all_reduce_(torch.tensor([float(r), -r], device=device), op="max")
    out["all_reduce_max"] = maxed.tolist()
    callers = [t.untyped_storage().data_ptr() for t in (full, half, mine, summed, maxed)]
    out["saw_callers_tensors"] = [t.untyped_storage().data_ptr() in callers for t in handed]
    out["backend"] = getattr(c, "backend", None)
    out["broadcast"] = c.broadcast_object({"from": r}, src=1)
    out["gathered"] = c.all_gather_object(("rank", r))
    c.barrier()
    c.end_step()
    out["stats"] = c.stats()
    c.close()
    return out


def mismatch() -> dict:
    # Same bytes on the wire, different ops: the transport completes, the check must not.
    c = comm.from_env(timeout=20, check=comm.CheckLevel.STEP)
    t = torch.ones(4)
    c.all_gather_into(torch.empty(8), torch.ones(4))
    c.all_reduce_(t, op="sum" if c.rank == 0 else "max")
    try:
        c.end_step()
    except comm.CollectiveMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


def mismatch_per_call() -> dict:
    # Different sizes would pair the wrong buffers: the per-call check stops it first.
    c = comm.from_env(timeout=20, check=comm.CheckLevel.CALL)
    n = 4 if c.rank == 0 else 6
    try:
        c.all_gather_into(torch.empty(2 * n), torch.ones(n))
    except comm.CollectiveMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


def stuck() -> dict:
    c = comm.from_env(timeout=3)
    if c.rank == 1:
        time.sleep(8)  # alive but never reaching the collective
        return {}
    t0 = time.monotonic()
    try:
        c.all_reduce_(torch.ones(2))
    except comm.CommError as e:
        return {"error": str(e), "elapsed_s": time.monotonic() - t0}
    return {"error": None}


def dead() -> dict:
    c = comm.from_env(timeout=20)
    if c.rank == 1:
        os._exit(3)  # dies without leaving the group
    t0 = time.monotonic()
    try:
        c.barrier()
    except comm.CommError as e:
        return {"error": str(e), "elapsed_s": time.monotonic() - t0}
    return {"error": None}


result = globals()[scenario]()
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)  # skip the process group's teardown: a peer may be gone
