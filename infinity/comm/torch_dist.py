"""`TorchDistributed`: the collectives over a torch.distributed process group.

gloo when the device is the CPU (tested: this is how the CPU-only test suite runs several
ranks); on a CUDA device NCCL for device tensors and gloo for CPU ones, in one group (see
[Note: which backend carries what]; tests/test_comm_backends.py checks both on one GPU and
skips without one).

[Note: which backend carries what] Some collectives carry CPU tensors whatever the device:
the exact gradient norm's integer bins, the logged loss, the stop flag, a user's tensor
through `deepspeed.comm.all_reduce`; and the object collectives (the cross-rank checks, the
ranks' agreement before a run) pickle into CPU tensors. A group with NCCL alone has no
backend for CPU tensors ("No backend type associated with device type cpu"), so a group made
here for a CUDA device is "cpu:gloo,cuda:nccl" (torch's device-mapped backend string):
device tensors go over NCCL, CPU tensors and the object collectives over gloo, and the
barrier is gloo's monitored barrier, which names the ranks that did not arrive. gloo rather
than staging every CPU tensor through the device: those tensors are a few bytes, a round
trip through the device would synchronize the host with it for each, and the object
collectives would then depend on which device is current. The cost is gloo's own connections
beside NCCL's, made at the same rendezvous. `dist.get_backend()` then returns that whole
string, so what carries a device type is read from the group's backend config
(`device_backends`), never by comparing names. A group the program made itself
(`dist.init_process_group("nccl")`; the Hugging Face Trainer's, made by accelerate on CUDA,
is one) is adopted as it is: when it has no backend for CPU tensors, a CPU tensor is staged
through this communicator's device (a copy there, the collective, a copy back in place),
synchronously since the copy back needs the result, so every verb takes CPU tensors on any
group. Such a group's object collectives run on the current CUDA device, which must then be
this rank's: the command line and the DeepSpeed shim (`init_distributed`, `zero.Init`) set
it from LOCAL_RANK before the group is used.

[Note: timeouts and dead ranks] Every collective waits at most `timeout_s` (the process
group's timeout). With gloo, a rank that exits closes its connections, so its peers fail at
their next collective at once ("Connection closed by peer"); a rank that is alive but stuck
(a hung disk, an endless loop) makes its peers fail after `timeout_s`. Either way the
failure reaches the caller as `CommError` naming this rank and the collective, and `barrier`
(gloo's monitored barrier) names the ranks that did not arrive. For the device tensors on
NCCL, torch's watchdog aborts the communicator after `timeout_s` and tears the process down
(the default TORCH_NCCL_ASYNC_ERROR_HANDLING), since a kernel stuck on the device cannot be
interrupted; the CPU tensors and the barrier of a "cpu:gloo,cuda:nccl" group fail as gloo's.

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
    """The backend of a group made for `device`: "cpu:gloo,cuda:nccl" for a CUDA device
    (see [Note: which backend carries what]), "gloo" otherwise."""
    return "cpu:gloo,cuda:nccl" if torch.device(device or "cpu").type == "cuda" else "gloo"


def device_backends(group: Any = None) -> dict[str, str]:
    """The backend carrying each device type's tensors in `group` (default: the world), from
    torch's record of how the group was made: "gloo" gives {"cpu": "gloo", "cuda": "gloo"},
    "nccl" {"cuda": "nccl"}, "cpu:gloo,cuda:nccl" both."""
    pairs = (pair.partition(":") for pair in dist.get_backend_config(group).split(","))
    return {device.strip(): backend.strip() for device, _, backend in pairs if backend}


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
        self.backends = device_backends()
        """The backend per device type (`device_backends`)."""
        self._stage = self._staging_device()
        """Where CPU tensors go for their collectives when the group has no backend for
        them; None when it has one."""
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

    def _staging_device(self) -> torch.device | None:
        """This communicator's device when the group has no backend for CPU tensors (they
        are staged there), else None; refuses a device the group has no backend for."""
        if self.device.type not in self.backends:
            if self._owns:
                dist.destroy_process_group()
            raise ValueError(
                f"the process group (backend {self.backend!r}) has no backend for "
                f"{self.device.type} tensors, the device given ({self.device}); pass the "
                f"device the group serves, or initialize it with {backend_for(self.device)!r}"
            )
        return None if "cpu" in self.backends else self.device

    def _staged(self, tensor: torch.Tensor) -> bool:
        return self._stage is not None and tensor.device.type == "cpu"

    def _through_stage(
        self, collective: Any, out: torch.Tensor, inp: torch.Tensor | None, **kwargs: Any
    ) -> None:
        """`collective(out[, inp])` on copies on the staging device, then `out` written in
        place (see [Note: which backend carries what]); `inp` None: in place on `out`."""
        if inp is None:
            staged = out.to(self._stage, copy=True)
            collective(staged, **kwargs)
        else:
            staged = torch.empty_like(out, device=self._stage)
            collective(staged, inp.to(self._stage, copy=True), **kwargs)
        out.copy_(staged)

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Any:
        if self._staged(out):
            return self._through_stage(_ALL_GATHER, out, shard)
        return _ALL_GATHER(out, shard, async_op=async_op)

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, async_op: bool) -> Any:
        if self._staged(out):
            return self._through_stage(_REDUCE_SCATTER, out, flat, op=dist.ReduceOp.SUM)
        return _REDUCE_SCATTER(out, flat, op=dist.ReduceOp.SUM, async_op=async_op)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        if self._staged(tensor):
            return self._through_stage(dist.all_reduce, tensor, None, op=_REDUCE[op])
        dist.all_reduce(tensor, op=_REDUCE[op])
        return None

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def _all_gather_object(self, obj: Any) -> list:
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _barrier(self) -> None:
        if self.backends.get("cpu") == "gloo":  # names the ranks that did not arrive
            # The group's own method: dist.monitored_barrier refuses any backend string
            # but "gloo", "cpu:gloo,cuda:nccl" included, though its gloo part has one.
            timeout = datetime.timedelta(seconds=self.timeout_s)
            dist.group.WORLD.monitored_barrier(timeout, wait_all_ranks=True)
        elif self.device.index is not None:  # NCCL's barrier on this rank's device
            dist.barrier(device_ids=[self.device.index])
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
