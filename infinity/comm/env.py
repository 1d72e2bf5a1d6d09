"""`from_env`: the right `Comm` for how this process was launched."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from infinity.comm.base import Comm
from infinity.comm.check import CheckLevel
from infinity.comm.single import SingleProcess
from infinity.comm.torch_dist import DEFAULT_TIMEOUT_S, TorchDistributed

TIMEOUT_ENV = "INFINITY_COMM_TIMEOUT_S"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def from_env(
    timeout: float | None = None,
    *,
    device: torch.device | str | None = None,
    check: CheckLevel | int | None = None,
) -> Comm:
    """`TorchDistributed` under torchrun (RANK, WORLD_SIZE > 1, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT set) or when the program already initialized torch.distributed;
    `SingleProcess` otherwise. `timeout` (seconds) bounds every collective (default:
    $INFINITY_COMM_TIMEOUT_S, else 600); `device` picks the backend (CUDA: NCCL with gloo
    for CPU tensors, else gloo; `backend_for`) and is where CPU tensors are staged on an
    adopted group that has no CPU backend; `check` the collective-sequence check (default:
    $INFINITY_COMM_CHECK)."""
    timeout_s = _timeout(timeout)
    if dist.is_initialized():
        return TorchDistributed(device=device, timeout_s=timeout_s, check=check)
    world = _int_var("WORLD_SIZE", 1)
    if world <= 1:
        return SingleProcess(check=check)
    missing = [v for v in _LAUNCH_VARS if not os.environ.get(v)]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with "
            "`torchrun --nproc_per_node N ...`, or unset WORLD_SIZE for a single process"
        )
    rank = _int_var("RANK", 0)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    return TorchDistributed(
        device=device,
        timeout_s=timeout_s,
        rank=rank,
        world_size=world,
        local_rank=_int_var("LOCAL_RANK", rank),
        local_world_size=_int_var("LOCAL_WORLD_SIZE", world),
        check=check,
    )


def _timeout(timeout: float | None) -> float:
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if isinstance(timeout, bool) or not float(timeout) > 0:
        raise ValueError(f"the collective timeout must be > 0 seconds, got {timeout!r}")
    return float(timeout)


def _int_var(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; torchrun sets it") from None
