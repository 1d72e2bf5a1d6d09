"""Child for test_nvme_state: a real write fails mid-sweep (RLIMIT_FSIZE below the extent of
sub-group 3: the kernel refuses writes there with EFBIG, as a full disk would with ENOSPC)
and the sweep must stop with a clean error. Prints one JSON line."""

from __future__ import annotations

import json
import resource
import signal
import sys

import torch

from infinity.io.aio import AioHandle
from infinity.swap.nvme_state import NvmeStateError, NvmeStateTier
from infinity.swap.store import SwapStore


def main(path: str, backend: str) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    numels = [4096] * 6
    out: dict = {}
    with SwapStore(path, run_id="fsize") as store, AioHandle(backend=backend) as aio:
        state = NvmeStateTier(numels, store=store, aio=aio, buffer_count=3)
        for i in range(len(numels)):
            state.initialize(i, torch.full((4096,), float(i)))
        ext = store.extent("optim", "subgroup.3")
        resource.setrlimit(resource.RLIMIT_FSIZE, (ext.offset, resource.RLIM_INFINITY))
        stepped = []
        try:
            for i, s in state.sweep():
                stepped.append(i)
                s.master.add_(1)
        except NvmeStateError as e:
            out["error"] = str(e)
        out["stepped"] = stepped
        out["residency"] = [r.name for r in state.residency]
        out["free_buffers"] = state.pool.free_count
        try:
            state.read(0)
        except NvmeStateError as e:
            out["later"] = str(e)
        state.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
