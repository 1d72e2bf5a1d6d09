"""Which base model a checkpoint belongs to, when it leaves the frozen weights out.

A checkpoint of a run with frozen parameters (a LoRA fine-tune) holds only the trainable
weights and the optimizer state by default; the frozen base comes back from where it was
loaded. The record written in its place names that base: the frozen parameters' names,
shapes and dtypes, and where they came from: a model directory (its path, a SHA-256 of its
safetensors index and of each shard's header plus a 64 KiB sample at each end of the data:
cheap, never hashing the whole 26 GB of a 13B), with a CRC-32 of each tensor the loader
read ([Note: base digests] in infinity.utils.tensor_digests), or a description such as a
preset and seed. `check_base` refuses a resume on a different base and says what differs;
`check_tensor` refuses a tensor read later (by an export) whose bytes changed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infinity.io import checksum
from infinity.utils import tensor_digests

log = logging.getLogger(__name__)

BASE_MODEL_KEY = "base_model"
"""Key of the record in a checkpoint's JSON state."""

_SAMPLE_BYTES = 64 << 10


def shard_fingerprint(path: Path) -> str:
    """SHA-256 of a safetensors file's size, header and the first and last 64 KiB of data."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        digest.update(raw + f.read(header_len))
        start = 8 + header_len
        digest.update(f.read(_SAMPLE_BYTES))
        f.seek(max(start, size - _SAMPLE_BYTES))
        digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def describe_dir(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The source record of a Hugging Face model directory: path and fingerprints."""
    root = Path(model_dir).expanduser().resolve()
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise ValueError(
            f"base model {root}: no *.safetensors file; point it at the directory the frozen "
            "weights were loaded from"
        )
    record: dict[str, Any] = {
        "path": str(root),
        "shards": {p.name: shard_fingerprint(p) for p in shards},
    }
    index = root / "model.safetensors.index.json"
    if index.is_file():
        record["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    read = {p.name: tensor_digests.remembered(p) for p in shards}
    if any(read.values()):
        record["tensors"] = {name: digests for name, digests in read.items() if digests}
    return record


def check_tensor(source: Mapping[str, Any], path: Path, name: str, tensor) -> None:
    """Refuse `tensor` (read whole from shard `path` of the base) when the base record holds
    a CRC-32 (or CRC-32C) of it, or of a span of it, that its bytes no longer match."""
    digest = (source.get("tensors") or {}).get(path.name, {}).get(name)
    if digest is None:
        return
    start, numel, crc, *kind = digest
    span = tensor.reshape(-1)[start : start + numel]
    if kind == [tensor_digests.CRC32C]:
        if not checksum.FAST_CRC32C:  # the Python twin would take hours for a large base
            log.warning("%s in %s: its CRC-32C is not checked (infinity._aio is not built)",
                        name, path)  # fmt: skip
            return
        actual = checksum.crc32c(span.contiguous())
    else:
        actual = tensor_digests.tensor_crc32(span)
    if actual != crc:
        raise ValueError(
            f"tensor {name!r} in {path} changed since the run loaded it from "
            f"{source.get('path')} (its checksum differs from the one recorded then): the base "
            "model's weights were edited or damaged; give --base the original model directory"
        )


def describe_base(
    frozen: Mapping[str, tuple[tuple[int, ...], str]],
    source: str | os.PathLike | Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The record of a base: `frozen` maps names to (shape, dtype name); `source` is a model
    directory, a JSON-able description (e.g. {"preset": "llama-13b", "seed": 0}) or None."""
    if source is None or isinstance(source, Mapping):
        described = dict(source) if source is not None else None
    else:
        described = describe_dir(source)
    return {
        "source": described,
        "frozen": {name: [list(shape), dtype] for name, (shape, dtype) in frozen.items()},
    }


def check_base(saved: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """Refuse (ValueError naming both bases) when `current` is not the base `saved` names."""
    problems = _frozen_differences(saved["frozen"], current["frozen"])
    problems += _source_differences(saved.get("source"), current.get("source"))
    if not problems:
        return
    was = _source_name(saved.get("source"))
    raise ValueError(
        f"checkpoint {where} was trained on a different base model ({was}) than this run's "
        f"({_source_name(current.get('source'))}): {'; '.join(problems[:4])}"
        f"{f' (and {len(problems) - 4} more)' if len(problems) > 4 else ''}. It holds only "
        f"the trainable weights, so it can resume only on its own base: build the model from "
        f"{was}, or start a new run in another save directory"
    )


def _frozen_differences(saved: Mapping[str, list], current: Mapping[str, list]) -> list[str]:
    problems = []
    missing = sorted(set(saved) - set(current))
    extra = sorted(set(current) - set(saved))
    if missing:
        problems.append(f"{len(missing)} frozen parameter(s) missing, e.g. {missing[0]!r}")
    if extra:
        problems.append(
            f"{len(extra)} frozen parameter(s) not in the checkpoint's base, e.g. {extra[0]!r}"
        )
    for name in sorted(set(saved) & set(current)):
        if list(saved[name]) != list(current[name]):
            problems.append(
                f"{name!r} is {current[name][0]} {current[name][1]}, was "
                f"{saved[name][0]} {saved[name][1]}"
            )
    return problems


def _source_differences(saved: Any, current: Any) -> list[str]:
    if saved is None:
        return []  # nothing was recorded beyond the shapes
    if current is None:
        return [f"this run does not say where its frozen weights came from (was {saved})"]
    if "shards" in saved and "shards" in current:
        problems = []
        if saved.get("index_sha256") != current.get("index_sha256"):
            problems.append("the safetensors index differs")
        if saved["shards"] != current["shards"]:
            changed = sorted(
                n
                for n in set(saved["shards"]) | set(current["shards"])
                if saved["shards"].get(n) != current["shards"].get(n)
            )
            problems.append(f"shard(s) {changed[:3]} differ (headers or data samples)")
        return problems
    return [] if dict(saved) == dict(current) else [f"base {current}, was {saved}"]


def _source_name(source: Any) -> str:
    if source is None:
        return "an unnamed base"
    if "path" in source:
        return str(source["path"])
    return ", ".join(f"{k} {v}" for k, v in source.items())
