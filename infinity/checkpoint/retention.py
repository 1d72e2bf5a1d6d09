"""Removing complete checkpoints on purpose: `--keep-last N` and a run started over.

Never removes the checkpoint `latest` names while it stays the newest, and removes nothing
that was not asked for. A checkpoint is first renamed into the stale area (`.tmp.removed.<tag>`,
one atomic step) and only then deleted, so a crash part way never leaves a directory that
looks complete but is missing shards; the next save clears what is left.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from infinity.checkpoint import layout
from infinity.checkpoint.metrics import FILE as METRICS_FILE
from infinity.checkpoint.reader import latest_tag, list_checkpoints
from infinity.utils.fsio import fsync_dir

log = logging.getLogger(__name__)


def _remove(save_dir: Path, tag: str) -> None:
    aside = save_dir / f"{layout.TMP_PREFIX}removed.{tag}"
    shutil.rmtree(aside, ignore_errors=True)  # left by a crash part way through a removal
    os.rename(save_dir / tag, aside)
    fsync_dir(save_dir)
    shutil.rmtree(aside)


def prune(save_dir: str | os.PathLike, keep_last: int) -> list[str]:
    """Remove all but the `keep_last` newest complete checkpoints; returns the removed tags.

    Call after a save has committed: the newest is then the one just written, and the one
    `latest` names is kept even if it is not among the newest.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    save_dir = Path(save_dir)
    tags = list_checkpoints(save_dir)
    keep = set(tags[-keep_last:]) | {latest_tag(save_dir)}
    removed = [tag for tag in tags if tag not in keep]
    for tag in removed:
        _remove(save_dir, tag)
    if removed:
        log.info("removed checkpoint(s) %s (keeping the last %d)", ", ".join(removed), keep_last)
    return removed


def start_over(save_dir: str | os.PathLike) -> list[str]:
    """Remove every checkpoint, `latest`, interrupted saves and metrics.jsonl (token caches
    stay): what `--overwrite` asks for. Returns the removed checkpoints' tags."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    tags = list_checkpoints(save_dir)
    (save_dir / layout.LATEST).unlink(missing_ok=True)  # first: never names a removed one
    fsync_dir(save_dir)
    for tag in tags:
        _remove(save_dir, tag)
    for entry in save_dir.glob(f"{layout.TMP_PREFIX}*"):
        shutil.rmtree(entry, ignore_errors=True)
    (save_dir / METRICS_FILE).unlink(missing_ok=True)
    fsync_dir(save_dir)
    return tags


__all__ = ["prune", "start_over"]
