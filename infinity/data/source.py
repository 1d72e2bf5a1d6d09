"""Read documents from a data file as a stream, with errors naming file and offset.

Owns which files are data and how each is read: a text file is one document, cut into
pieces (infinity.data.text); a JSONL file holds one JSON object per line and a .json file
a JSON array of objects or JSON lines (infinity.data.records), the document in a field
("text" by default). gzip, bzip2 and xz files are read through the standard library and
zstd where Python has it; the format is that of the name inside (corpus.jsonl.gz is
JSONL). Nothing reads the whole file into memory.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from infinity.data.records import (
    JSON_ADVICE,
    iter_array_records,
    iter_json_array,
    iter_json_lines,
    iter_line_records,
)
from infinity.data.text import iter_pieces

CHUNK_BYTES = 64 << 10
FORMATS = ("auto", "text", "jsonl", "json")

# How each compression's files begin, and the suffix its files carry.
_MAGIC = {
    "gzip": (b"\x1f\x8b", ".gz"),
    "bzip2": (b"BZh", ".bz2"),
    "xz": (b"\xfd7zXZ\x00", ".xz"),
    "zstd": (b"\x28\xb5\x2f\xfd", ".zst"),
}
_JSONL_ADVICE = "each line of a JSONL file must be one JSON object"
_COMPRESSED_SUFFIXES = {".gz", ".gzip", ".bz2", ".xz", ".zst", ".zstd"}


def compression(path: Path) -> str | None:
    """The compression `path` is in, from its first bytes (None: not compressed)."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((name for name, (magic, _) in _MAGIC.items() if head.startswith(magic)), None)


def detect_format(path: Path, fmt: str = "auto") -> str:
    """'text', 'jsonl' or 'json': `fmt`, or with 'auto' the suffix of the name inside a
    compression suffix (corpus.jsonl.gz is JSONL)."""
    if fmt not in FORMATS:
        raise ValueError(f"data format {fmt!r} is not supported; use one of {FORMATS}")
    if fmt != "auto":
        return fmt
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSED_SUFFIXES:
        suffixes.pop()
    suffix = suffixes[-1] if suffixes else ""
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}.get(suffix, "text")


def check_data_options(path: Path, field: str, fmt: str = "auto") -> None:
    """Before tokenizing: the file's compression can be read, and --data-field (a field of
    JSON records) is refused for a plain-text file."""
    kind = compression(path)
    if kind is not None:
        with _decompressor(path, kind):
            pass
    if field != "text" and detect_format(path, fmt) == "text":
        raise ValueError(
            f"--data-field {field} names a field of JSON records, but {path} is read as plain "
            "text (one document); drop --data-field, or give the records as JSON lines "
            "(.jsonl) or a JSON array (.json)"
        )


@contextlib.contextmanager
def open_data(path: Path) -> Iterator[BinaryIO]:
    """The file's bytes, decompressed when it is compressed."""
    kind = compression(path)
    if kind is None:
        with open(path, "rb") as f:
            yield f
        return
    with _decompressor(path, kind) as f:
        try:
            yield f
        except (EOFError, lzma.LZMAError, gzip.BadGzipFile, OSError, *_zstd_errors()) as exc:
            if isinstance(exc, OSError) and exc.errno is not None:
                raise  # a failed read of the disk, not damaged data
            raise ValueError(
                f"data file {path} is {kind}-compressed and its data is damaged or cut short "
                f"({exc}); test it with `{kind} -t {path}` or fetch it again"
            ) from None


def _zstd_errors() -> tuple[type[BaseException], ...]:
    """The error types of whichever zstd module is loaded (none: zstd is not read)."""
    found = []
    for module, name in (("compression.zstd", "ZstdError"), ("zstandard", "ZstdError")):
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, name):
            found.append(getattr(loaded, name))
    return tuple(found)


def _decompressor(path: Path, kind: str) -> BinaryIO:
    if kind == "gzip":
        return gzip.open(path, "rb")
    if kind == "bzip2":
        return bz2.open(path, "rb")
    if kind == "xz":
        return lzma.open(path, "rb")
    try:
        from compression import zstd  # Python 3.14

        return zstd.open(path, "rb")
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        raise ValueError(
            f"data file {path} is zstd-compressed and this Python cannot read zstd; "
            f"decompress it first (`zstd -d {path}`) or `pip install zstandard`"
        ) from None
    return zstandard.open(path, "rb")


def check_data_file(path: str | os.PathLike) -> Path:
    """`path` as a Path if it is a readable, non-empty regular file; else an error saying what
    it is instead. A pipe or device is refused: the token cache is keyed by size and mtime."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"data file {path} does not exist; pass a text, JSONL or JSON file"
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


def iter_documents(
    path: str | os.PathLike, *, fmt: str = "auto", field: str = "text"
) -> Iterator[tuple[str, bool]]:
    """Yield (text, ends_document): the pieces of a text file ([Note: text pieces] in
    infinity.data.text), one per record of JSON lines or a JSON array."""
    path = check_data_file(path)
    fmt = detect_format(path, fmt)
    kind = compression(path)
    where = f" of the {kind}-decompressed data" if kind else ""
    with open_data(path) as stream:
        if fmt == "text":
            yield from iter_pieces(stream, path, CHUNK_BYTES, where)
        elif fmt == "jsonl" or (fmt == "json" and not _is_array(path)):
            advice = JSON_ADVICE if fmt == "json" else _JSONL_ADVICE
            yield from iter_json_lines(stream, path, field, advice)
        else:
            yield from iter_json_array(stream, path, field, CHUNK_BYTES)


def iter_records(path: str | os.PathLike, *, fmt: str = "auto") -> Iterator[tuple[str, object]]:
    """Yield (where, value) per record of a JSONL or JSON file ("line N" / "element N"); a
    plain-text file has no records and is refused."""
    path = check_data_file(path)
    fmt = detect_format(path, fmt)
    if fmt == "text":
        raise ValueError(f"data file {path} is read as plain text, which holds no records")
    with open_data(path) as stream:
        if fmt == "jsonl" or not _is_array(path):
            advice = JSON_ADVICE if fmt == "json" else _JSONL_ADVICE
            yield from iter_line_records(stream, path, advice)
        else:
            yield from iter_array_records(stream, path, CHUNK_BYTES)


def _is_array(path: Path) -> bool:
    """Whether a .json file's first non-space byte opens an array (else: JSON lines)."""
    with open_data(path) as stream:
        while block := stream.read(4096):
            block = block.lstrip()
            if block:
                return block[:1] == b"["
    return False
