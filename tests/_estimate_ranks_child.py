"""One rank of the estimate's sharded exactness test: trains the tiny Llama of
tests/test_estimate.py and prints a JSON line with its memory_stats after the build and
after each optimizer step, and the bytes of its own swap files after the build.

argv: nvme directory, the config as JSON, steps.
"""

import json
import os
import pathlib
import sys

import torch

import infinity
from infinity import comm
from infinity.models import LlamaConfig, LlamaForCausalLM

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def run(c: comm.Comm, nvme_dir: str, cfg: dict, steps: int) -> dict:
    torch.manual_seed(0)  # the same weights on every rank
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    engine = infinity.initialize(model, cfg, comm=c)
    mine = f"rank{c.rank}"
    files = [p for p in pathlib.Path(nvme_dir).rglob("*.swp") if mine in str(p)]
    disk = sum(os.path.getsize(p) for p in files)
    stats = [engine.memory_stats()]
    g = torch.Generator().manual_seed(1 + c.rank)
    try:
        for _ in range(steps):
            for _ in range(cfg["gradient_accumulation_steps"]):
                ids = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=g)
                engine.backward(engine(ids, ids))
                engine.step()
            stats.append(engine.memory_stats())
    finally:
        engine.close()
    return {"stats": stats, "disk": disk}


if __name__ == "__main__":
    nvme_dir, cfg, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    c = comm.from_env(timeout=60)
    result = run(c, nvme_dir, cfg, steps)
    c.close()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
