"""Read checkpoints: resolve `latest`, verify checksums, stream tensors back one at a time.

Reading never modifies SAVE_DIR. Every problem is an error naming the file and the fix:
`CheckpointNotFoundError` (a FileNotFoundError) when there is nothing to resume from,
`CheckpointCorruptError` (a ValueError) for truncated, corrupted or inconsistent files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from infinity.checkpoint import layout
from infinity.utils.safetensors_stream import SafetensorsReader, file_digests


class CheckpointNotFoundError(FileNotFoundError):
    """There is no (such) checkpoint to load."""


class CheckpointCorruptError(ValueError):
    """A checkpoint file is truncated, corrupted or does not match its metadata."""


def list_checkpoints(save_dir: str | os.PathLike) -> list[str]:
    """Tags of the complete checkpoints in SAVE_DIR (those with metadata), oldest first."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    tags = [
        p.name
        for p in save_dir.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / layout.METADATA).is_file()
    ]
    return sorted(tags, key=lambda t: (save_dir / t / layout.METADATA).stat().st_mtime_ns)


def latest_tag(save_dir: str | os.PathLike) -> str | None:
    """The tag `latest` names, or None when SAVE_DIR has no complete checkpoint."""
    try:
        tag = (Path(save_dir) / layout.LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return tag or None


def _resolve(save_dir: Path, tag: str | None) -> str:
    if tag is not None:
        layout.check_tag(tag)
        if not (save_dir / tag).is_dir():
            others = list_checkpoints(save_dir)
            raise CheckpointNotFoundError(
                f"checkpoint {tag!r} not found in {save_dir}; available: {others or 'none'}"
            )
        return tag
    if not save_dir.is_dir():
        raise CheckpointNotFoundError(
            f"no checkpoint to resume from: {save_dir} does not exist; check --save-dir, or start "
            "without --resume"
        )
    tag = latest_tag(save_dir)
    if tag is None:
        raise CheckpointNotFoundError(
            f"no checkpoint to resume from in {save_dir} (no '{layout.LATEST}' file); "
            "start without --resume, or point --save-dir at the directory a previous run saved into"
        )
    if not (save_dir / tag / layout.METADATA).is_file():
        raise CheckpointCorruptError(
            f"{save_dir / layout.LATEST} names {tag!r} but {save_dir / tag / layout.METADATA} is "
            f"missing; load one of {list_checkpoints(save_dir) or 'none'} by tag"
        )
    return tag


class Checkpoint:
    """A complete checkpoint on disk: metadata in memory, tensors read on demand."""

    def __init__(self, path: Path, metadata: dict) -> None:
        self.path = path
        self.metadata = metadata
        self.tag: str = metadata["tag"]
        self.step: int = metadata["step"]
        self.world_size: int = metadata["world_size"]
        self.state: dict = metadata["state"]

    def _shard(self, rank: int) -> dict:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"checkpoint {self.path} was saved by {self.world_size} rank(s); rank {rank} has "
                f"no shard: resume with the same world size"
            )
        return self.metadata["shards"][rank]

    def rng_state(self, rank: int = 0) -> dict | None:
        return self._shard(rank)["rng"]

    def shard_path(self, rank: int = 0) -> Path:
        return self.path / self._shard(rank)["file"]

    def verify(self, ranks: list[int] | None = None) -> None:
        """Check size and SHA-256 of the shards of `ranks` (all by default) against the metadata."""
        for rank in range(self.world_size) if ranks is None else ranks:
            rec = self._shard(rank)
            path = self.path / rec["file"]
            fix = (
                "restore the file from a copy, or load an earlier checkpoint by tag "
                f"(available: {list_checkpoints(self.path.parent)})"
            )
            if not path.is_file():
                raise CheckpointCorruptError(f"checkpoint shard {path} is missing; {fix}")
            size = path.stat().st_size
            if size != rec["nbytes"]:
                raise CheckpointCorruptError(
                    f"checkpoint shard {path} is truncated or altered: {size} bytes, the metadata "
                    f"says {rec['nbytes']}; {fix}"
                )
            header_sha, data_sha, _ = file_digests(path)
            if header_sha != rec["header_sha256"] or data_sha != rec["data_sha256"]:
                part = "header" if header_sha != rec["header_sha256"] else "data"
                raise CheckpointCorruptError(
                    f"checkpoint shard {path} is corrupted: SHA-256 of its {part} does not match "
                    f"the metadata; {fix}"
                )

    def tensor_names(self, rank: int = 0) -> list[str]:
        with SafetensorsReader(self.shard_path(rank)) as f:
            return f.names()

    def tensors(self, rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in file order, one tensor read at a time."""
        with SafetensorsReader(self.shard_path(rank)) as f:
            for name in f.names():
                yield name, f.get_tensor(name)

    def get_tensor(self, name: str, rank: int = 0) -> torch.Tensor:
        with SafetensorsReader(self.shard_path(rank)) as f:
            return f.get_tensor(name)


def _read_metadata(path: Path) -> dict:
    meta_path = path / layout.METADATA
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{meta_path} is missing: {path} is not a complete checkpoint; load another tag"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"{meta_path} is not valid JSON ({exc}); it was damaged: restore it or load another tag"
        ) from None
    if meta.get("format") != layout.FORMAT:
        raise CheckpointCorruptError(
            f"{meta_path} is not an Infinity checkpoint (format={meta.get('format')!r})"
        )
    if meta.get("version", 0) > layout.VERSION:
        raise CheckpointCorruptError(
            f"{meta_path} has format version {meta['version']}, newer than this Infinity "
            f"understands ({layout.VERSION}); upgrade Infinity"
        )
    return meta


def load_checkpoint(
    save_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    verify: bool = True,
    ranks: list[int] | None = None,
) -> Checkpoint:
    """Open checkpoint `tag` (default: the one `latest` names) and verify its shards' checksums.

    `ranks` limits verification to those ranks' shards (a rank need only verify its own).
    """
    save_dir = Path(save_dir)
    tag = _resolve(save_dir, tag)
    ckpt = Checkpoint(save_dir / tag, _read_metadata(save_dir / tag))
    if verify:
        ckpt.verify(ranks)
    return ckpt
