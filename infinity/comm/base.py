"""The communication interface every rank-aware component codes against.

`Comm` owns the public collectives: it checks their arguments, counts bytes and calls per
op, times the waits, records the sequence for the cross-rank check (`infinity.comm.check`)
and turns transport failures into `CommError`. Subclasses (`SingleProcess`,
`TorchDistributed`) only move the data. It owns no policy: what to gather or reduce, and
when, is the caller's.

[Note: counted bytes] `comm_<op>_bytes` counts each collective's full buffer: the gathered
output of an all-gather, the input of a reduce-scatter, the tensor of an all-reduce, the
"algorithm bytes" that ZeRO's communication volume is stated in (all-gather the parameters
in forward and in backward, reduce-scatter the gradients: 3x the model's bytes per step).
A ring implementation sends (W-1)/W of it from each rank. `SingleProcess` counts the calls
and 0 bytes: nothing leaves the process.
"""

from __future__ import annotations

import abc
import time
from typing import Any, Literal

import torch

from infinity.comm.check import (
    CheckLevel,
    Collective,
    CollectiveLog,
    CollectiveMismatchError,
    level_from_env,
)

ReduceOp = Literal["sum", "max", "min"]
REDUCE_OPS = ("sum", "max", "min")
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast_object", "all_gather_object")


class CommError(RuntimeError):
    """A collective failed: a peer died, timed out or sent something else."""


class Work:
    """A collective in flight (`async_op=True`) or finished: `wait()` blocks until its
    output is ready and raises `CommError` if it failed; `done()` does not block. Keeps its
    buffers alive until waited."""

    __slots__ = ("_comm", "_handle", "_what", "_buffers")

    def __init__(self, comm: Comm, handle: Any, what: str, buffers: tuple = ()) -> None:
        self._comm = comm
        self._handle = handle
        self._what = what
        self._buffers = buffers

    def wait(self) -> None:
        handle, self._handle = self._handle, None
        self._buffers = ()
        if handle is None:
            return
        t0 = time.perf_counter()
        try:
            handle.wait()
        except Exception as e:
            raise self._comm._error(self._what, e) from e
        finally:
            self._comm._wait_s += time.perf_counter() - t0

    def done(self) -> bool:
        return self._handle is None or bool(self._handle.is_completed())


class Comm(abc.ABC):
    """World size, ranks and the collectives of one process group.

    Ranks must call the collectives in the same order with the same sizes (see
    `infinity.comm.check`). `all_gather_into` and `reduce_scatter_into` take flat
    contiguous tensors: rank r's shard is elements [r*S, (r+1)*S) of the full buffer.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    timeout_s: float
    """Seconds a collective may wait for its peers before it fails with `CommError`."""

    def __init__(self, *, check: CheckLevel | int | None = None) -> None:
        self.check = level_from_env() if check is None else CheckLevel(check)
        self._log = CollectiveLog()
        self._step_checks = 0
        self._bytes = dict.fromkeys(OPS, 0)
        self._calls = dict.fromkeys((*OPS, "barrier"), 0)
        self._wait_s = 0.0
        self._in_flight: list[Work] = []

    # -- the transport, per implementation ----------------------------------------------
    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Any: ...

    @abc.abstractmethod
    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, async_op: bool) -> Any: ...

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None: ...

    @abc.abstractmethod
    def _broadcast_object(self, obj: Any, src: int) -> Any: ...

    @abc.abstractmethod
    def _all_gather_object(self, obj: Any) -> list: ...

    @abc.abstractmethod
    def _barrier(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the process group (idempotent)."""

    @property
    def moves_bytes(self) -> bool:
        """Whether collectives leave the process (bytes are counted)."""
        return self.world_size > 1

    # -- the collectives ----------------------------------------------------------------
    def all_gather_into(
        self, out_flat: torch.Tensor, local_shard: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """out_flat[r*S:(r+1)*S] = rank r's `local_shard` (S elements) for every r."""
        _check_flat("all_gather_into", out_flat, local_shard, self.world_size)
        self._enter("all_gather", out_flat, out_flat.nbytes)
        handle = self._run(
            "all_gather", out_flat, self._all_gather, out_flat, local_shard, async_op
        )
        return self._work(handle, "all_gather", out_flat, (out_flat, local_shard))

    def reduce_scatter_into(
        self, out_shard: torch.Tensor, in_flat: torch.Tensor, *, async_op: bool = False
    ) -> Work:
        """out_shard = the sum over ranks of in_flat[r*S:(r+1)*S], r this rank's index."""
        _check_flat("reduce_scatter_into", in_flat, out_shard, self.world_size)
        self._enter("reduce_scatter", in_flat, in_flat.nbytes)
        handle = self._run(
            "reduce_scatter", in_flat, self._reduce_scatter, out_shard, in_flat, async_op
        )
        return self._work(handle, "reduce_scatter", in_flat, (out_shard, in_flat))

    def all_reduce_(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce `tensor` over the ranks in place (sum, max or min); returns it."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce_: op must be one of {REDUCE_OPS}, got {op!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"all_reduce_: expected a tensor, got {type(tensor).__name__}")
        self._enter(f"all_reduce_{op}", tensor, tensor.nbytes, counter="all_reduce")
        self._run("all_reduce", tensor, self._all_reduce, tensor, op)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` (picklable) on every rank."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast_object: src {src} is not a rank of {self.world_size}")
        self._enter_object("broadcast_object")
        return self._run("broadcast_object", None, self._broadcast_object, obj, src)

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's `obj` (picklable), in rank order."""
        self._enter_object("all_gather_object")
        return self._run("all_gather_object", None, self._all_gather_object, obj)

    def barrier(self) -> None:
        """Wait until every rank is here (fails after `timeout_s`)."""
        self._calls["barrier"] += 1
        self._record(Collective("barrier", 0, "-"))
        self._run("barrier", None, self._barrier)

    def finish_in_flight(self) -> None:
        """Wait for every collective started with `async_op=True` that nobody waited for
        (an aborted step leaves some); raises the first one's `CommError` after waiting for
        all of them."""
        works, self._in_flight = self._in_flight, []
        first: CommError | None = None
        for work in works:
            try:
                work.wait()
            except CommError as e:
                first = first or e
        if first is not None:
            raise first

    # -- the check ----------------------------------------------------------------------
    def end_step(self) -> None:
        """The end of an optimizer step: with the check on (`INFINITY_COMM_CHECK`), compare
        this step's collective sequence across ranks and raise `CollectiveMismatchError` at
        the first difference; then start a new sequence."""
        self._step_checks += 1
        if self.check and self.world_size > 1:
            what = f"optimizer step {self._step_checks}"
            self._run("check", None, self._log.compare, self._all_gather_object, what)
        self._log.reset()

    def stats(self) -> dict[str, int]:
        """`comm_<op>_bytes` (see [Note: counted bytes]) and `comm_<op>_calls` per op, and
        `comm_wait_us`: time blocked in collectives and in `Work.wait`."""
        out = {f"comm_{op}_bytes": n for op, n in self._bytes.items() if op in OPS[:3]}
        out.update({f"comm_{op}_calls": n for op, n in self._calls.items()})
        out["comm_wait_us"] = int(self._wait_s * 1e6)
        return out

    def __enter__(self) -> Comm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    # -- bookkeeping --------------------------------------------------------------------
    def _enter(self, op: str, t: torch.Tensor, nbytes: int, counter: str | None = None) -> None:
        counter = counter or op
        self._calls[counter] += 1
        if self.moves_bytes:
            self._bytes[counter] += nbytes
        self._record(Collective(op, t.numel(), str(t.dtype).removeprefix("torch.")))

    def _enter_object(self, op: str) -> None:
        self._calls[op] += 1
        self._record(Collective(op, 0, "object"))

    def _record(self, c: Collective) -> None:
        if not self.check:
            return
        self._log.record(c)
        if self.check >= CheckLevel.CALL and self.world_size > 1:
            what = f"optimizer step {self._step_checks + 1} (checked per collective)"
            self._run("check", None, self._log.compare, self._all_gather_object, what)

    def _run(self, op: str, t: torch.Tensor | None, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except (CollectiveMismatchError, CommError, ValueError, TypeError):
            raise
        except Exception as e:
            what = op if t is None else f"{op} of {t.numel()} {str(t.dtype)[6:]} elements"
            raise self._error(what, e) from e
        finally:
            self._wait_s += time.perf_counter() - t0

    def _work(self, handle: Any, op: str, t: torch.Tensor, buffers: tuple) -> Work:
        work = Work(self, handle, f"{op} of {t.numel()} {str(t.dtype)[6:]} elements", buffers)
        if handle is not None:
            self._in_flight = [w for w in self._in_flight if w._handle is not None]
            self._in_flight.append(work)
        return work

    def _error(self, what: str, cause: BaseException) -> CommError:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return CommError(
            f"rank {self.rank} of {self.world_size}: {what} (collective #{self._calls_total()}) "
            f"failed: {first[:300]}. A peer rank exited, failed or did not reach this "
            f"collective within timeout_s={self.timeout_s:g}; look at the other ranks' output "
            "for the first error"
        )

    def _calls_total(self) -> int:
        return sum(self._calls.values())


def _check_flat(what: str, full: torch.Tensor, shard: torch.Tensor, world_size: int) -> None:
    for name, t in (("full", full), ("shard", shard)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: the {name} buffer must be a tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{what}: the {name} buffer must be contiguous (pass a flat view)")
    if full.numel() != shard.numel() * world_size:
        raise ValueError(
            f"{what}: the full buffer has {full.numel()} elements but world_size "
            f"({world_size}) x the shard's {shard.numel()} is {shard.numel() * world_size}; "
            "pad the full buffer to world_size x shard numel"
        )
    if full.dtype != shard.dtype or full.device != shard.device:
        raise ValueError(
            f"{what}: full ({full.dtype}, {full.device}) and shard ({shard.dtype}, "
            f"{shard.device}) buffers must share dtype and device"
        )
