"""Read documents from a text or JSONL file as a stream, with errors naming file and offset.

A text file is one document, read in chunks of whole lines; a JSONL file holds one JSON
object per line with the document in a field ("text" by default). Nothing reads the whole
file into memory.
"""

from __future__ import annotations

import json
import os
import stat
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
    """`path` as a Path if it is a readable, non-empty regular file; else an error saying what
    it is instead. A pipe or device is refused: the token cache is keyed by size and mtime."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"data file {path} does not exist; pass a text or JSONL file"
        ) from None
    except OSError as exc:
        raise OSError(exc.errno, f"data file {path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        what = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        hint = " (e.g. corpus.jsonl inside it)" if stat.S_ISDIR(st.st_mode) else ""
        raise ValueError(
            f"data file {path} is {what}; pass one text or JSONL file{hint}. Data is read twice "
            "(tokenized into a cache keyed by the file's size and time), so save a stream to a "
            "file first"
        )
    if st.st_size == 0:
        raise ValueError(f"data file {path} is empty; pass a file with text in it")
    if not os.access(path, os.R_OK):
        raise PermissionError(
            f"data file {path} is not readable by this user; fix its permissions (chmod u+r)"
        )
    return path


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


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
            yield _text_of(path, lineno, record, field), True


def _text_of(path: Path, lineno: int, record, field: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(
            f"{path} line {lineno} is a JSON {type(record).__name__}, not an object; each line "
            f'of a JSONL file must be one object such as {{"{field}": "..."}}'
        )
    if field not in record:
        raise ValueError(
            f"{path} line {lineno} has no field {field!r} (it has {sorted(record)}); name the "
            "field that holds the text with --data-field NAME"
        )
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(
            f"{path} line {lineno}: field {field!r} is a JSON {type(text).__name__}, not a "
            "string; --data-field must name the field that holds the text"
        )
    return text
