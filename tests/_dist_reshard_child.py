"""One rank of the 8-bit reshard tests: builds the Zoo model with AdamW8bit, optionally
loads a checkpoint, trains some global batches (from the checkpoint's step on), optionally
saves, and prints a JSON line with the global losses and the weights' sums.
argv: load directory ("-": none), save directory ("-": none), steps, tier (cpu|nvme), swap
directory.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from _engine_models import Zoo, batches, config

import infinity
from infinity import comm

GLOBAL_BATCH = 4
TOTAL_STEPS = 4


def run(c: comm.Comm, load: str, save: str, steps: int, tier: str, swap: str) -> dict:
    torch.manual_seed(0)
    zero = {"sub_group_size": 4096}
    if tier == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap}
    cfg = config(**zero)
    cfg["optimizer"]["type"] = "AdamW8bit"
    cfg["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // c.world_size
    engine = infinity.initialize(Zoo(d=64), cfg, comm=c)
    if load != "-":
        engine.load_checkpoint(load)
    per_rank = GLOBAL_BATCH // c.world_size
    data = batches(TOTAL_STEPS, batch=GLOBAL_BATCH, seq=8)
    losses = []
    for ids in data[engine.global_steps : engine.global_steps + steps]:
        mine = ids[c.rank * per_rank : (c.rank + 1) * per_rank]
        loss = engine(mine, mine)
        engine.backward(loss)
        engine.step()
        losses.append(sum(c.all_gather_object(loss.item())) / c.world_size)
    if save != "-":
        engine.save_checkpoint(save)
    weights = {n: w.sum().item() for n, w in engine.named_parameters_host()}
    engine.close()
    return {"losses": losses, "weight_sums": weights}


if __name__ == "__main__":
    load, save, steps, tier, swap = sys.argv[1:6]
    c = comm.from_env(timeout=60)
    result = run(c, load, save, int(steps), tier, swap)
    c.close()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
