"""Communication between ranks: the one place that talks torch.distributed.

`Comm` is the interface (ranks, flat all-gather and reduce-scatter, all-reduce, object
collectives, barrier, byte/call counters, the cross-rank collective check); `SingleProcess`
is the world of one, `TorchDistributed` a process group (gloo on the CPU; on CUDA NCCL, with
gloo for CPU tensors), and `from_env()` picks between them from torchrun's environment.
"""

from __future__ import annotations

from infinity.comm.base import Comm, CommError, ReduceOp, Work
from infinity.comm.check import ENV_VAR as CHECK_ENV_VAR
from infinity.comm.check import CheckLevel, CollectiveMismatchError
from infinity.comm.env import TIMEOUT_ENV, from_env
from infinity.comm.single import SingleProcess
from infinity.comm.torch_dist import TorchDistributed

__all__ = [
    "CHECK_ENV_VAR",
    "TIMEOUT_ENV",
    "CheckLevel",
    "CollectiveMismatchError",
    "Comm",
    "CommError",
    "ReduceOp",
    "SingleProcess",
    "TorchDistributed",
    "Work",
    "from_env",
]
