"""CRC-32 digests of the tensors read from safetensors files, remembered per file.

[Note: base digests] A checkpoint of a LoRA run names its frozen base by path and a cheap
fingerprint of each shard (its header and 64 KiB at each end), which an edit in the middle
of a shard leaves unchanged. So the loader takes a checksum of each tensor's bytes as it reads
them (they are in memory already: one more pass over them) and remembers it here, keyed
by the file with its size and modification time; the base record takes them
(`checkpoint.base_model.describe_dir`) and an export checks each tensor it reads against
them. CRC-32 finds any accidental change (and any edit not crafted to keep it); it is not a
defense against a deliberate forgery. A digest is `[start, numel, crc]` for zlib's CRC-32, or
`[start, numel, crc, "crc32c"]` for CRC-32C: the loader that reads at the disk's speed takes
the native CRC-32C kernel where the extension is built (zlib's CRC-32 ran at 1.5-2.3 GB/s on
the development machine, under the disk's 3.5), and records which it took.
"""

from __future__ import annotations

import os
import zlib

import torch

_REMEMBERED: dict[str, tuple[tuple[int, int], dict[str, list[int | str]]]] = {}
"""Real path -> ((size, mtime_ns) when read, {tensor name: digest (see the module note)})."""


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a contiguous tensor's bytes."""
    if tensor.numel() == 0:
        return 0
    return zlib.crc32(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


CRC32C = "crc32c"
"""The kind of a digest taken with CRC-32C (no kind: zlib's CRC-32)."""


def remember(
    path: str | os.PathLike, name: str, start: int, numel: int, crc: int, kind: str = ""
) -> None:
    """Record that elements [start, start + numel) of `name` in `path` had checksum `crc`:
    zlib's CRC-32, or CRC-32C with `kind=CRC32C`."""
    if kind not in ("", CRC32C):
        raise ValueError(f"digest kind {kind!r} is not known; use '' (CRC-32) or {CRC32C!r}")
    real = os.path.realpath(path)
    stamp = _stamp(real)
    held = _REMEMBERED.get(real)
    if held is None or held[0] != stamp:
        held = _REMEMBERED[real] = (stamp, {})
    held[1][name] = [start, numel, crc, kind] if kind else [start, numel, crc]


def remembered(path: str | os.PathLike) -> dict[str, list[int | str]] | None:
    """The digests read from `path` in this process, if it has not changed since."""
    real = os.path.realpath(path)
    held = _REMEMBERED.get(real)
    if held is None or not os.path.exists(real) or held[0] != _stamp(real):
        return None
    return dict(held[1])
