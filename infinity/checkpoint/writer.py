"""Atomic, streamed checkpoint saves.

A save builds `SAVE_DIR/.tmp.<tag>/`: each rank streams its tensors into its own safetensors
shard (one tensor in memory at a time) and leaves a small JSON record of the shard (size,
SHA-256 of header and data, RNG state). Rank 0 then merges the records into
`checkpoint.json`, fsyncs everything, renames the directory to `<tag>` and only then
replaces `latest`. A crash at any moment leaves `latest` naming a complete checkpoint.

Multi-rank use (the engine's seam): rank 0 calls `begin_save`, all ranks wait at a barrier,
every rank calls `attach_save(...).write_shard(rank, ...)`, barrier, rank 0 calls `commit`.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from infinity.checkpoint import jsonfloat, layout, lock
from infinity.checkpoint.rng import capture_rng_state
from infinity.utils.fsio import fault_point, fsync_dir, write_file_atomic
from infinity.utils.safetensors_stream import StreamingSafetensorsWriter

log = logging.getLogger(__name__)

TensorEntry = tuple[str, "torch.Tensor | Callable[[], torch.Tensor]"]


def _save_error(save_dir: Path, tag: str, exc: OSError) -> OSError:
    hint = {
        errno.ENOSPC: "free space on that file system or point --save-dir at another one",
        errno.EDQUOT: "raise the disk quota or point --save-dir elsewhere",
        errno.EFBIG: "the file-size limit (ulimit -f) is too small for a shard; raise it",
        errno.EACCES: "make the directory writable or choose another --save-dir",
        errno.EROFS: "the file system is read-only; choose another --save-dir",
    }.get(exc.errno, "check the file system, then save again")
    prev = _latest_or_none(save_dir)
    kept = f"previous checkpoint {prev!r} is intact" if prev else "no earlier checkpoint existed"
    message = (
        f"saving checkpoint {tag!r} into {save_dir} failed: {exc.strerror or exc}; {hint} "
        f"(the partial save was removed; {kept})"
    )
    if exc.filename is None:  # str() would end in ": None"
        return OSError(exc.errno, message)
    return OSError(exc.errno, message, exc.filename)


def _latest_or_none(save_dir: Path) -> str | None:
    try:
        return (save_dir / layout.LATEST).read_text().strip() or None
    except OSError:
        return None


class PendingCheckpoint:
    """A save in progress under `.tmp.<tag>`. Use `write_shard` per rank, then `commit` once."""

    def __init__(self, save_dir: Path, tag: str, *, lock_fd: int | None) -> None:
        self.save_dir = save_dir
        self.tag = tag
        self.tmp = layout.tmp_dir(save_dir, tag)
        self._lock_fd = lock_fd
        self._done = False

    def write_shard(
        self, rank: int, tensors: Iterable[TensorEntry], *, rng_state: dict | None | bool = True
    ) -> dict:
        """Stream (name, tensor) or (name, callable -> tensor) entries into rank's shard.

        Each tensor is written and released before the next is requested, so a generator that
        swaps tensors in one at a time keeps memory at one tensor. `rng_state=True` records
        this process's RNG states; pass a dict to record given states or None for none.
        """
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        name = layout.shard_name(rank)
        try:
            with StreamingSafetensorsWriter(self.tmp / name) as writer:
                count = 0
                for entry in tensors:
                    tname, value = entry
                    tensor = value() if callable(value) else value
                    if not isinstance(tensor, torch.Tensor):
                        raise TypeError(
                            f"checkpoint entry {tname!r} is {type(tensor).__name__}, not a tensor; "
                            "yield (name, tensor) or (name, callable returning a tensor)"
                        )
                    writer.add(tname, tensor)
                    del tensor, value
                    count += 1
            record = {
                "file": name,
                "rank": rank,
                "nbytes": writer.nbytes,
                "header_sha256": writer.header_sha256,
                "data_sha256": writer.data_sha256,
                "num_tensors": count,
                "rng": capture_rng_state() if rng_state is True else (rng_state or None),
            }
            write_file_atomic(self.tmp / f"{name}.json", jsonfloat.dumps(record).encode())
        except OSError as exc:
            if rank == 0:
                self.abort()
            raise _save_error(self.save_dir, self.tag, exc) from exc
        except BaseException:
            if rank == 0:
                self.abort()
            raise
        return record

    def commit(self, *, step: int, state: dict | None = None, world_size: int = 1) -> Path:
        """Rank 0: merge the shard records, fsync, rename into place, then update `latest`."""
        if self._done:
            raise ValueError(f"checkpoint {self.tag!r} was already committed or aborted")
        try:
            shards = []
            for rank in range(world_size):
                rec_path = self.tmp / f"{layout.shard_name(rank)}.json"
                if not rec_path.exists():
                    raise ValueError(
                        f"rank {rank} did not write its shard of checkpoint {self.tag!r}; "
                        f"every rank must call write_shard before rank 0 commits "
                        f"(world_size={world_size})"
                    )
                shards.append(jsonfloat.loads(rec_path.read_text()))
            meta = {
                "format": layout.FORMAT,
                "version": layout.VERSION,
                "tag": self.tag,
                "step": int(step),
                "world_size": world_size,
                "created_unix_s": time.time(),
                "state": state or {},
                "shards": shards,
            }
            try:
                meta[layout.METADATA_SUM] = layout.metadata_sum(meta)
                payload = jsonfloat.dumps(meta, indent=1).encode()
            except (TypeError, ValueError) as exc:
                raise TypeError(
                    f"checkpoint state must be JSON-serializable (numbers, strings, lists, "
                    f"dicts; no tensors or objects): {exc}; convert values with .item() / "
                    "float() / lists first"
                ) from exc
            write_file_atomic(self.tmp / layout.METADATA, payload)
            for rank in range(world_size):
                os.unlink(self.tmp / f"{layout.shard_name(rank)}.json")
            fsync_dir(self.tmp)
            fault_point("commit:before_rename")
            os.rename(self.tmp, self.save_dir / self.tag)
            fsync_dir(self.save_dir)
            fault_point("commit:after_rename")
            write_file_atomic(self.save_dir / layout.LATEST, (self.tag + "\n").encode())
            fault_point("commit:after_latest")
        except OSError as exc:
            self.abort()
            raise _save_error(self.save_dir, self.tag, exc) from exc
        except BaseException:
            self.abort()
            raise
        self._finish()
        log.info("saved checkpoint %s (step %d)", self.save_dir / self.tag, step)
        return self.save_dir / self.tag

    def abort(self) -> None:
        """Remove the partial save and release the lock. `latest` is untouched."""
        if self._done:
            return
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._finish()

    def _finish(self) -> None:
        self._done = True
        if self._lock_fd is not None:
            lock.unlock(self._lock_fd)
            self._lock_fd = None


def _lock(save_dir: Path) -> int | None:
    """Hold SAVE_DIR for one save; None when this process already holds it for a run."""
    if lock.held_here(save_dir):
        return None
    fd = lock.try_lock(save_dir)
    if fd is None:
        raise lock.plain_os_error(
            errno.EBUSY,
            f"another process is saving into or training in {save_dir}: "
            f"{lock.describe_holder(save_dir)}; wait for it or use a different --save-dir",
        )
    lock.record_holder(fd, " ".join(sys.argv))
    return fd


def clean_stale(save_dir: Path) -> list[Path]:
    """Remove leftovers of crashed saves (`.tmp.*` directories and temp files)."""
    removed = []
    for entry in save_dir.iterdir():
        if entry.name.startswith(layout.TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        elif entry.name.startswith(f".{layout.LATEST}.tmp-") and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    if removed:
        log.warning("removed %d leftover(s) of interrupted saves in %s", len(removed), save_dir)
        fsync_dir(save_dir)
    return removed


def _set_aside_existing(save_dir: Path, tag: str, pending: PendingCheckpoint) -> None:
    """An existing `tag` that `latest` does not name is superseded: move it into the stale
    area (removed next). That happens after a crash between rename and `latest`, or when a
    run resumed from an earlier checkpoint reaches the same step again. The checkpoint
    `latest` names is never moved: it is the one a crash must leave loadable.
    """
    if not (save_dir / tag).exists():
        return
    if _latest_or_none(save_dir) == tag:
        pending.abort()
        raise ValueError(
            f"checkpoint {save_dir / tag} exists and is the latest; it cannot be replaced "
            "without a moment where no complete checkpoint exists: save under another tag"
        )
    os.rename(save_dir / tag, save_dir / f"{layout.TMP_PREFIX}superseded.{tag}")
    fsync_dir(save_dir)


def begin_save(save_dir: str | os.PathLike, tag: str) -> PendingCheckpoint:
    """Rank 0: lock SAVE_DIR, clean stale temps and create `.tmp.<tag>` for the shards."""
    save_dir = Path(save_dir)
    layout.check_tag(tag)
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _save_error(save_dir, tag, exc) from exc
    lock_fd = _lock(save_dir)
    pending = PendingCheckpoint(save_dir, tag, lock_fd=lock_fd)
    try:
        _set_aside_existing(save_dir, tag, pending)
        clean_stale(save_dir)
        pending.tmp.mkdir()
        fsync_dir(save_dir)
    except OSError as exc:
        pending.abort()
        raise _save_error(save_dir, tag, exc) from exc
    return pending


def attach_save(save_dir: str | os.PathLike, tag: str) -> PendingCheckpoint:
    """Ranks other than 0: join the save rank 0 began (after a barrier)."""
    pending = PendingCheckpoint(Path(save_dir), layout.check_tag(tag), lock_fd=None)
    if not pending.tmp.is_dir():
        raise ValueError(
            f"no save of {tag!r} in progress in {save_dir}; rank 0 calls begin_save first"
        )
    return pending


def save_checkpoint(
    save_dir: str | os.PathLike,
    tensors: Iterable[TensorEntry],
    *,
    step: int,
    state: dict | None = None,
    tag: str | None = None,
    rng_state: dict | None | bool = True,
) -> Path:
    """Single-process save: one shard, then commit. Returns the checkpoint's directory."""
    pending = begin_save(save_dir, tag or layout.step_tag(step))
    pending.write_shard(0, tensors, rng_state=rng_state)
    return pending.commit(step=step, state=state, world_size=1)
