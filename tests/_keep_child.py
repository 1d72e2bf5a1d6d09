"""One rank of the two-rank kept-weights test: trains the same case with nothing kept, then
with every trainable weight kept, and prints a JSON line with both runs.

argv: dtype, accum, tier (cpu|nvme), nvme directory."""

import json
import os
import sys

from _keep import keep_config, train_counting

from infinity import comm

if __name__ == "__main__":
    dtype, accum, tier, nvme_dir = sys.argv[1:5]
    c = comm.from_env(timeout=60)
    runs = {}
    for name, keep in (("plain", 0), ("kept", 10**9)):
        path = os.path.join(nvme_dir, name)
        os.makedirs(path, exist_ok=True)
        cfg = keep_config(dtype=dtype, accum=int(accum), tier=tier, nvme_dir=path, keep=keep)
        runs[name] = train_counting(cfg, comm=c, rank=c.rank, world=c.world_size)
    c.close()
    print("RESULT " + json.dumps(runs), flush=True)
    os._exit(0)
