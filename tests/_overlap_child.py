"""One rank of the two-rank overlapped-step test: trains the same case with
`offload_optimizer.overlap_step` off, then on, and prints a JSON line with both runs.

argv: dtype, clip, accum, tier (cpu|nvme), nvme directory."""

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
        runs[str(overlap)] = train(cfg, comm=c, rank=c.rank, world=c.world_size)
    c.close()
    print("RESULT " + json.dumps(runs), flush=True)
    os._exit(0)
