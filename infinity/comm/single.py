"""`SingleProcess`: the world of one. Collectives are copies or nothing at all."""

from __future__ import annotations

from typing import Any

import torch

from infinity.comm.base import Comm, ReduceOp
from infinity.comm.check import CheckLevel


class SingleProcess(Comm):
    """Rank 0 of 1: every collective is a local copy (or a no-op), counted as a call that
    moves 0 bytes, so single-process runs behave exactly as they did without a comm."""

    def __init__(self, *, check: CheckLevel | int | None = None) -> None:
        super().__init__(check=check)
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.local_world_size = 1
        self.timeout_s = float("inf")

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool) -> None:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, async_op: bool) -> None:
        if out.data_ptr() != flat.data_ptr():
            out.copy_(flat)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        pass  # the reduction over one rank is the tensor itself

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def _all_gather_object(self, obj: Any) -> list:
        return [obj]

    def _barrier(self) -> None:
        pass

    def close(self) -> None:
        pass
