"""`deepspeed.comm` and `deepspeed.init_distributed` over `infinity.comm`: the one process
group this package's engines share, and the calls training scripts commonly make on it.

The group comes from torchrun's environment (`infinity.comm.from_env`); there is no
`deepspeed` launcher here. Collectives beyond an all-reduce and a barrier raise
NotImplementedError naming what to use instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from infinity.accelerator import get_accelerator, use_local_device
from infinity.comm import Comm, from_env

logger = logging.getLogger(__name__)

_COMM: Comm | None = None


def shared() -> Comm:
    """The process group every engine `infinity.deepspeed.initialize` builds runs on (made
    from the environment on first use; never closed by an engine)."""
    global _COMM
    if _COMM is None:
        _COMM = _join()
    return _COMM


def use_rank_device() -> None:
    """Under torchrun, make LOCAL_RANK's CUDA device the current one (as DeepSpeed's engine
    and zero.Init do): the accelerator takes the current device when first used, and the
    object collectives of a group the script made with NCCL alone run on it."""
    if os.environ.get("LOCAL_RANK"):
        use_local_device(int(os.environ["LOCAL_RANK"]))


def _join(timeout_s: float | None = None) -> Comm:
    use_rank_device()
    return from_env(timeout_s, device=get_accelerator().device)


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: Any = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...); one
    process when launched without it. The backend follows the device (on CUDA NCCL, with
    gloo for CPU tensors; gloo on the CPU); a group the script already made is adopted.
    `rank`/`world_size` must agree with the environment."""
    del dist_backend, auto_mpi_discovery, distributed_port, verbose, dist_init_required, config
    if init_method is not None:
        raise NotImplementedError(
            f"init_distributed: init_method={init_method!r} is not supported; launch with "
            "`torchrun --nproc_per_node N script.py`, which sets the rendezvous"
        )
    comm = shared() if timeout is None else _with_timeout(timeout)
    for name, given, actual in (
        ("rank", rank, comm.rank),
        ("world_size", world_size, comm.world_size),
    ):
        if given != -1 and given != actual:
            raise ValueError(
                f"init_distributed: {name}={given} but the environment says {actual}; leave "
                f"{name} out (torchrun sets it)"
            )


def _with_timeout(timeout: Any) -> Comm:
    global _COMM
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    if _COMM is None:
        _COMM = _join(seconds)
    return _COMM


def is_initialized() -> bool:
    return _COMM is not None


def get_rank(group: Any = None) -> int:
    return shared().rank


def get_world_size(group: Any = None) -> int:
    return shared().world_size


def get_local_rank() -> int:
    return shared().local_rank


def barrier(group: Any = None) -> None:
    shared().barrier()


class ReduceOp:
    """DeepSpeed's (and torch's) names for the reductions `all_reduce` takes."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op=False):
    """Reduce `tensor` in place over the ranks (sum, max or min)."""
    name = str(op).rsplit(".", 1)[-1].lower()
    if name not in ("sum", "max", "min") or group is not None or async_op:
        raise NotImplementedError(
            f"all_reduce: op={op!r}, group={group!r}, async_op={async_op!r}: only a blocking "
            "sum, max or min over all ranks is implemented"
        )
    shared().all_reduce_(tensor, name)
    return None


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(
        f"deepspeed.comm.{name} is not implemented by infinity.deepspeed: the engine does its "
        "own collectives; for others use torch.distributed directly (the group torchrun "
        "starts is initialized by then)"
    )
