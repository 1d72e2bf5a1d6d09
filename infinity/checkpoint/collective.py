"""One checkpoint saved by every rank at once.

Owns the order of a multi-rank save (rank 0 begins it, every rank writes its own shard in
parallel, rank 0 commits) and turns a failure on any rank into a failure of the save on every
rank, named by rank, so that no rank waits for a shard that will never come and the previous
checkpoint stays the latest. It takes the run's communicator (anything with `rank`,
`world_size` and `all_gather_object`, such as `infinity.comm`'s) and never imports
torch.distributed itself.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infinity.checkpoint.writer import (
    PendingCheckpoint,
    TensorEntry,
    attach_save,
    begin_save,
    save_checkpoint,
)


def save_on_all_ranks(
    save_dir: str | os.PathLike,
    tensors: Iterable[TensorEntry],
    *,
    comm: Any,
    step: int,
    state: dict | None,
    tag: str,
) -> Path:
    """Every rank calls this with its own tensors (its spans) and the same `state`; returns
    the checkpoint's directory on every rank. One rank: exactly `save_checkpoint`."""
    if comm.world_size == 1:
        return save_checkpoint(save_dir, tensors, step=step, state=state, tag=tag)
    rank = comm.rank
    pending: PendingCheckpoint | None = None
    failure: Exception | None = None
    if rank == 0:
        try:
            pending = begin_save(save_dir, tag)
        except (OSError, ValueError) as exc:
            failure = exc
    _agree(comm, failure, "beginning it")
    try:
        if rank != 0:
            pending = _attach(save_dir, tag)
        assert pending is not None
        pending.write_shard(rank, tensors)
    except (OSError, ValueError, TypeError) as exc:
        failure = exc
    try:
        _agree(comm, failure, "writing the shards")
    except BaseException:
        if pending is not None and rank == 0:
            pending.abort()  # every rank has finished writing: the partial save can go
        raise
    path = Path(save_dir) / tag
    if rank == 0:
        assert pending is not None
        try:
            path = pending.commit(step=step, state=state, world_size=comm.world_size)
        except (OSError, ValueError, TypeError) as exc:
            failure = exc
    _agree(comm, failure, "committing it")
    return path


def _attach(save_dir: str | os.PathLike, tag: str) -> PendingCheckpoint:
    try:
        return attach_save(save_dir, tag)
    except ValueError as exc:
        raise ValueError(
            f"{exc}; every rank must see the same --save-dir: on several hosts it must be on "
            "a file system they share"
        ) from None


def _summary(exc: Exception | None) -> dict | None:
    if exc is None:
        return None
    code = exc.errno if isinstance(exc, OSError) else None
    return {"type": type(exc).__name__, "errno": code, "message": str(exc)}


def _agree(comm: Any, failure: Exception | None, what: str) -> None:
    """All ranks learn whether any failed; each then raises: its own error, or one naming
    the first rank that failed and why."""
    reports = comm.all_gather_object(_summary(failure))
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    if not failed:
        return
    if failure is not None:
        raise failure
    rank, report = failed[0]
    message = (
        f"saving the checkpoint failed on rank {rank} while {what}: "
        f"{report['type']}: {report['message']}"
    )
    if report["errno"] is not None or report["type"] == "OSError":
        raise OSError(report["errno"] or errno.EIO, message)
    raise ValueError(message)


__all__ = ["save_on_all_ranks"]
