"""Read checkpoints: resolve `latest`, verify checksums, stream tensors back one at a time.

Reading never modifies SAVE_DIR. Every problem is an error naming the file and the fix:
`CheckpointNotFoundError` (a FileNotFoundError) when there is nothing to resume from,
`CheckpointCorruptError` (a ValueError) for truncated, corrupted or inconsistent files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from infinity.checkpoint import jsonfloat, layout
from infinity.checkpoint.spans import SpanReader
from infinity.utils.safetensors_stream import SafetensorsReader, file_digests

log = logging.getLogger(__name__)


class CheckpointNotFoundError(FileNotFoundError):
    """There is no (such) checkpoint to load."""


class CheckpointCorruptError(ValueError):
    """A checkpoint file is truncated, corrupted or does not match its metadata."""


class CheckpointUnverifiedError(CheckpointCorruptError):
    """A checkpoint's metadata carries no checksum and the caller did not accept that."""


ACCEPT_FLAG = "--accept-unverified-checkpoint"
"""The CLI flag that loads a checkpoint whose metadata has no checksum (`accept_unverified`
in Python); the refusal names both."""


def _created(save_dir: Path, tag: str) -> float:
    """When checkpoint `tag` was committed: its metadata's time (which survives a copy of
    SAVE_DIR that resets file times), else its metadata file's modification time."""
    meta_path = save_dir / tag / layout.METADATA
    try:
        return float(jsonfloat.loads(meta_path.read_text())["created_unix_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return meta_path.stat().st_mtime


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
    return sorted(tags, key=lambda t: (_created(save_dir, t), t))


def latest_tag(save_dir: str | os.PathLike) -> str | None:
    """The tag `latest` names, or None when SAVE_DIR has no complete checkpoint."""
    try:
        tag = (Path(save_dir) / layout.LATEST).read_text().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    return tag or None


def find_checkpoint(save_dir: str | os.PathLike, *, accept_unverified: bool = False) -> str:
    """The checkpoint to resume from or export: the newest complete one whose checksums verify.

    Normally that is the one `latest` names (not verified here: loading does it). When
    `latest` is missing, empty, names no complete checkpoint, or a complete checkpoint was
    committed after the one it names (a crash between the two), the newer checkpoints are
    verified newest first and the first that passes is chosen, with a warning. Reads only.
    `accept_unverified`: see `load_checkpoint`.
    """
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        what = "is not a directory" if save_dir.exists() else "does not exist"
        raise CheckpointNotFoundError(f"no checkpoint in {save_dir}: that path {what}")
    complete = list_checkpoints(save_dir)
    latest = latest_tag(save_dir)
    if latest is not None and complete and complete[-1] == latest:
        return latest
    newer = complete[complete.index(latest) + 1 :] if latest in complete else complete
    skipped = []
    for tag in reversed(newer):
        try:
            Checkpoint(save_dir / tag, _read_metadata(save_dir / tag, accept_unverified)).verify()
        except (CheckpointCorruptError, KeyError, TypeError) as exc:
            skipped.append(f"{tag} ({exc})")
            continue
        why = (
            f"'{layout.LATEST}' names {latest!r}"
            if latest
            else f"'{layout.LATEST}' is missing or empty"
        )
        log.warning(
            "%s in %s, but %s is the newest complete checkpoint and its checksums verify: "
            "using it%s", why, save_dir, tag, f"; skipped {'; '.join(skipped)}" if skipped else "",
        )  # fmt: skip
        return tag
    if latest in complete:
        return latest  # the newer ones are damaged: the one `latest` names is loaded
    stale = [p.name for p in save_dir.glob(f"{layout.TMP_PREFIX}*")]
    found = [f"{len(stale)} interrupted save(s) ({', '.join(sorted(stale))})"] if stale else []
    found += [f"damaged checkpoint {s}" for s in skipped]
    raise CheckpointNotFoundError(
        f"no {'checkpoint that verifies' if skipped else 'complete checkpoint'} in {save_dir}"
        + (f" ('{layout.LATEST}' names {latest!r}, which is not there)" if latest else "")
        + (f"; found only: {'; '.join(found)}" if found else "")
    )


def _resolve(save_dir: Path, tag: str | None, accept_unverified: bool) -> str:
    if tag is None:
        return find_checkpoint(save_dir, accept_unverified=accept_unverified)
    layout.check_tag(tag)
    if not (save_dir / tag).is_dir():
        others = list_checkpoints(save_dir)
        raise CheckpointNotFoundError(
            f"checkpoint {tag!r} not found in {save_dir}; available: {others or 'none'}"
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
            fix = _damage_fix(self.path)
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

    def full_tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` whole: as saved with one rank, else the saved ranks' spans joined
        and given the shape recorded at save time (state["engine"]["shapes"], flat without)."""
        if self.world_size == 1:
            return self.get_tensor(name)
        with SpanReader(self.path, [self.shard_path(r) for r in range(self.world_size)]) as r:
            numel = r.saved_numel(name)
            flat = r.read(name, numel, 0, numel)
        shape = self.state.get("engine", {}).get("shapes", {}).get(name.split("/", 1)[-1])
        return flat.reshape(shape) if shape is not None else flat

    def span_reader(self) -> SpanReader:
        """Reads any span of a tensor from the shards of all saved ranks (see
        `infinity.checkpoint.spans`): how a checkpoint loads under another world size."""
        return SpanReader(self.path, [self.shard_path(r) for r in range(self.world_size)])


def _damage_fix(path: Path) -> str:
    """How to go on from damaged checkpoint `path`, without deleting anything."""
    others = [t for t in list_checkpoints(path.parent) if t != path.name]
    if not others:
        return "restore the file from a copy (no other checkpoint exists in that directory)"
    return (
        f"restore the file from a copy, or move {path} out of {path.parent} (keep it) and load "
        f"again: the newest checkpoint that verifies is taken (others: {', '.join(others)})"
    )


def _read_metadata(path: Path, accept_unverified: bool = False) -> dict:
    meta_path = path / layout.METADATA
    try:
        meta = jsonfloat.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{meta_path} is missing: {path} is not a complete checkpoint; load another tag"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"{meta_path} is not valid JSON ({exc}); it was damaged: restore it or load another tag"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != layout.FORMAT:
        kind = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointCorruptError(f"{meta_path} is not an Infinity checkpoint (format={kind!r})")
    if meta.get("version", 0) > layout.VERSION:
        raise CheckpointCorruptError(
            f"{meta_path} has format version {meta['version']}, newer than this Infinity "
            f"understands ({layout.VERSION}); upgrade Infinity"
        )
    _check_metadata_sum(meta_path, meta, accept_unverified)
    return meta


def _check_metadata_sum(meta_path: Path, meta: dict, accept_unverified: bool) -> None:
    """[Note: metadata checksum] in layout.py: a mismatch is damage; no sum is refused
    unless accepted (an old save, or a deleted sum: the two look alike)."""
    saved = meta.get(layout.METADATA_SUM)
    if saved is None:
        what = f"{meta_path} has no checksum ({layout.METADATA_SUM})"
        if not accept_unverified:
            raise CheckpointUnverifiedError(
                f"{what}: its step, data position and state cannot be verified (it was "
                f"written by an Infinity before checkpoints carried one, or the checksum was "
                f"removed). If you trust this checkpoint, load it anyway with {ACCEPT_FLAG} "
                f"(accept_unverified=True in Python)"
            )
        log.warning("%s: loaded unverified, as %s asks", what, ACCEPT_FLAG)
        return
    if saved != layout.metadata_sum(meta):
        raise CheckpointCorruptError(
            f"{meta_path} does not match its checksum ({layout.METADATA_SUM}): its step, data "
            f"position or state were edited or damaged; {_damage_fix(meta_path.parent)}"
        )


def load_checkpoint(
    save_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    verify: bool = True,
    ranks: list[int] | None = None,
    accept_unverified: bool = False,
) -> Checkpoint:
    """Open checkpoint `tag` (default: the one `latest` names) and verify its shards' checksums.

    `ranks` limits verification to those ranks' shards (a rank need only verify its own).
    A checkpoint.json without its own checksum raises `CheckpointUnverifiedError` unless
    `accept_unverified` (see [Note: metadata checksum] in layout.py).
    """
    save_dir = Path(save_dir)
    tag = _resolve(save_dir, tag, accept_unverified)
    ckpt = Checkpoint(save_dir / tag, _read_metadata(save_dir / tag, accept_unverified))
    if verify:
        ckpt.verify(ranks)
    return ckpt
