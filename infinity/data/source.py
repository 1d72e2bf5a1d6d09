"""Read documents from a text or JSONL file as a stream, with errors naming file and offset.

A text file is one document, read in chunks of whole lines; a JSONL file holds one JSON
object per line with the document in a field ("text" by default). Nothing reads the whole
file into memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

CHUNK_BYTES = 1 << 20
FORMATS = ("auto", "text", "jsonl")


def detect_format(path: Path, fmt: str = "auto") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"data format {fmt!r} is not supported; use one of {FORMATS}")
    if fmt != "auto":
        return fmt
    return "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "text"


def check_data_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist; pass a text or JSONL file")
    if path.stat().st_size == 0:
        raise ValueError(f"data file {path} is empty; pass a file with text in it")
    return path


def _decode(path: Path, raw: bytes, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = offset + exc.start
        raise ValueError(
            f"data file {path} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at byte offset "
            f"{bad}; convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove that byte"
        ) from None


def iter_documents(
    path: str | os.PathLike, *, fmt: str = "auto", field: str = "text"
) -> Iterator[tuple[str, bool]]:
    """Yield (text, ends_document). Text files give line-aligned chunks of ~1 MiB."""
    path = check_data_file(path)
    fmt = detect_format(path, fmt)
    if fmt == "text":
        yield from _iter_text(path)
    else:
        yield from _iter_jsonl(path, field)


def _iter_text(path: Path) -> Iterator[tuple[str, bool]]:
    offset = 0
    buf: list[bytes] = []
    buf_start = buf_len = 0
    with open(path, "rb") as f:
        for line in f:
            if not buf:
                buf_start = offset
            buf.append(line)
            buf_len += len(line)
            offset += len(line)
            if buf_len >= CHUNK_BYTES:
                yield _decode(path, b"".join(buf), buf_start), False
                buf, buf_len = [], 0
    yield (_decode(path, b"".join(buf), buf_start) if buf else ""), True


def _iter_jsonl(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            line = _decode(path, raw, start).strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path} line {lineno} (byte offset {start}) is not valid JSON: {exc.msg}; "
                    "each line of a JSONL file must be one JSON object"
                ) from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path} line {lineno} has no field {field!r} (it has {keys}); pass the "
                    "field holding the text (--data-field / field=...)"
                )
            text = record[field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{path} line {lineno}: field {field!r} is {type(text).__name__}, not a string"
                )
            yield text, True
