"""Child process for the crash tests: save checkpoint A, then checkpoint B with a fault armed."""

import os
import sys

import torch

from infinity.checkpoint import save_checkpoint
from infinity.utils.fsio import reset_fault_points


def tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    for i in range(4):
        yield f"w{i}", (lambda i=i: torch.randn(64, 32 + i, generator=g))


save_dir = sys.argv[1]
fault_at = sys.argv[2]
save_checkpoint(save_dir, tensors(1), step=1, state={"loss_scale": 1024.0})
os.environ["INFINITY_FAULT_AT"] = fault_at
reset_fault_points()
save_checkpoint(save_dir, tensors(2), step=2, state={"loss_scale": 512.0})
print("finished")
