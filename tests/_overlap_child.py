"""One rank of the two-rank overlapped-step test: trains the same case with
`offload_optimizer.overlap_step` off, then on, and prints a JSON line with both runs.

argv: dtype, clip, accum, tier (cpu|nvme), nvme directory, and optionally "uneven": rank 1
steps one sub-group early at most (`overlap_numel`), as a rank whose worker fell behind."""

import json
import os
import sys

from _overlap import overlap_config, train

from infinity import comm

if __name__ == "__main__":
    dtype, clip, accum, tier, nvme_dir = sys.argv[1:6]
    c = comm.from_env(timeout=60)
    runs = {}
    for overlap in (False, True):
        path = os.path.join(nvme_dir, f"overlap{int(overlap)}")
        os.makedirs(path, exist_ok=True)
        case = dict(dtype=dtype, clip=clip, accum=int(accum), tier=tier, nvme_dir=path)
        cfg = overlap_config(**case, overlap=overlap)
        if sys.argv[6:] == ["uneven"]:  # every weight stays gathered: steps refresh them
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**6
            if c.rank == 1:
                cfg["zero_optimization"]["offload_optimizer"]["overlap_numel"] = 2048
        runs[str(overlap)] = train(cfg, comm=c, rank=c.rank, world=c.world_size)
    c.close()
    print("RESULT " + json.dumps(runs), flush=True)
    os._exit(0)
