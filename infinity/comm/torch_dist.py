"""`TorchDistributed`: the collectives over a torch.distributed process group.

gloo when the device is the CPU (tested: this is how the CPU-only test suite runs several
ranks), NCCL when it is a CUDA device (written to the same interface, untested until a GPU
machine runs it).

[Note: timeouts and dead ranks] Every collective waits at most `timeout_s` (the process
group's timeout). With gloo, a rank that exits closes its connections, so its peers fail at
their next collective at once ("Connection closed by peer"); a rank that is alive but stuck
(a hung disk, an endless loop) makes its peers fail after `timeout_s`. Either way the
failure reaches the caller as `CommError` naming this rank and the collective, and `barrier`
(gloo's monitored barrier) names the ranks that did not arrive. With NCCL, torch's watchdog
aborts the communicator after `timeout_s` and tears the process down (the default
TORCH_NCCL_ASYNC_ERROR_HANDLING), since a kernel stuck on the device cannot be interrupted.

[Note: leaving the group] A gloo group runs threads of its own that take the GIL; if the group
is still alive while the interpreter shuts down, one of them can take a GIL that is no longer
there and the process aborts (SIGABRT, exit code -6) after a run that succeeded. So `close`
waits for the collectives still in flight (`Comm.finish_in_flight`), then destroys the group,
and an `atexit` hook closes a group its owner forgot to. Destroying is not enough if something
else still holds the group: `torch.distributed.nn.functional` binds `group.WORLD` as a default
argument when it is first imported, and transformers imports it, so importing it after the
group exists keeps the group alive for the life of the process. This module imports it first,
while `group.WORLD` is still None, and `close` warns if the group outlives its destruction.
Exit can therefore take up to `timeout_s` when a peer is stuck in a collective.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 (before any group: see the note)

from infinity.comm.base import Comm, CommError, ReduceOp
from infinity.comm.check import CheckLevel

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# all_gather_single/reduce_scatter_single replace the *_tensor names in recent torch.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def backend_for(device: torch.device | str | None) -> str:
    """ "nccl" for a CUDA device, "gloo" otherwise."""
    return "nccl" if torch.device(device or "cpu").type == "cuda" else "gloo"


class TorchDistributed(Comm):
    """A process group: joined here from the environment (`init_method`, default env://,
    as torchrun sets it), or adopted when the program already initialized one (then
    `close` leaves it to the program)."""

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        init_method: str | None = None,
        check: CheckLevel | int | None = None,
    ) -> None:
        super().__init__(check=check)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.device = torch.device(device or "cpu")
        self.timeout_s = float(timeout_s)
        self._owns = not dist.is_initialized()
        if self._owns:
            backend = backend or backend_for(self.device)
            kwargs = {"rank": rank, "world_size": world_size} if rank is not None else {}
            dist.init_process_group(
                backend,
                init_method=init_method or "env://",
                timeout=datetime.timedelta(seconds=self.timeout_s),
                **kwargs,
            )
        self.backend = dist.get_backend()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if rank is not None and (rank, world_size) != (self.rank, self.world_size):
            raise ValueError(
                f"the process group is rank {self.rank} of {self.world_size}, but rank "
                f"{rank} of {world_size} was asked for"
            )
        self.local_rank = self.rank if local_rank is None else int(local_rank)
        self.local_world_size = self.world_size if local_world_size is None else local_world_size
        self._closed = False
        if self._owns:
            atexit.register(self.close)
        logger.debug("joined %s process group as rank %d of %d", self.backend, self.rank,
                     self.world_size)  # fmt: skip

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Any:
        return _ALL_GATHER(out, shard, async_op=async_op)

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, async_op: bool) -> Any:
        return _REDUCE_SCATTER(out, flat, op=dist.ReduceOp.SUM, async_op=async_op)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        dist.all_reduce(tensor, op=_REDUCE[op])

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def _all_gather_object(self, obj: Any) -> list:
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _barrier(self) -> None:
        if self.backend == "gloo":  # names the ranks that did not arrive
            timeout = datetime.timedelta(seconds=self.timeout_s)
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group this object joined (an adopted one stays), after the
        collectives still in flight finish (see [Note: leaving the group])."""
        if self._closed:
            return
        self._closed = True
        if not self._owns:
            return
        atexit.unregister(self.close)
        if not dist.is_initialized():
            return
        try:
            self.finish_in_flight()
        except CommError as e:
            logger.warning("leaving the process group: %s", e)
        group = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        gc.collect()
        if group() is not None:
            logger.warning(
                "the process group is still referenced after it was destroyed, so its "
                "threads may outlive the interpreter and abort the process at exit; "
                "import torch.distributed.nn.functional before the group is created"
            )
