"""A plain-text document in pieces of about one chunk: UTF-8 checked as it streams, cut where
a byte-level BPE tokenizer would split anyway.

[Note: text pieces] A text file is one document, but a tokenizer given a whole large file
holds many times its size in memory while it works (100 MB of text took 3.1 GB; 2 GB
aborted inside the Rust tokenizer). So the text is read in chunks of `chunk_bytes` and cut
into pieces, each tokenized on its own. A piece ends just before a space or newline that has a
non-space character on both sides: the pre-tokenizers of byte-level BPE (GPT-2, Llama 3,
Qwen, ...) split there too, so the ids are the same as those of the whole file, and with
UTF-8 bytes they always are. A run of `MAX_CHUNKS` chunks with no such place (no spaces at
all) is cut at a character boundary. Other tokenizers (SentencePiece's leading "▁") may
split one word differently at a cut, about once per chunk (64 KiB). The rule and the
chunk size are in the token cache's key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

MAX_CHUNKS = 4
RULE = "pieces-before-inner-space-v1"

# A space or newline between two non-space characters: where a piece may end.
_CUT = re.compile(r"(?<=\S)[ \n](?=\S)")
_TAIL_CHARS = 1 << 14


def decode(path: Path, raw: bytes, offset: int, where: str = "") -> str:
    """`raw` as UTF-8; an error names the byte and its offset in the file."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = offset + exc.start
        raise ValueError(
            f"data file {path} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at byte offset "
            f"{bad}{where}; convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove "
            "that byte"
        ) from None


def _whole_chars(data: bytes) -> int:
    """The length of `data` without a character torn at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): does its character fit?
            need = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if need <= back else len(data) - back
    return len(data)  # not UTF-8 at all: decode names the byte


def decoded_chunks(
    stream: BinaryIO, path: Path, chunk_bytes: int, where: str = ""
) -> Iterator[str]:
    """The stream as text, about `chunk_bytes` at a time, never splitting a character."""
    pending, offset = b"", 0
    while raw := stream.read(chunk_bytes):
        data = pending + raw
        end = _whole_chars(data)
        yield decode(path, data[:end], offset, where)
        offset += end
        pending = data[end:]
    if pending:
        decode(path, pending, offset, where)  # a character torn at the end of the file
        raise AssertionError("unreachable: a torn character always fails to decode")


def iter_pieces(
    stream: BinaryIO, path: Path, chunk_bytes: int, where: str = ""
) -> Iterator[tuple[str, bool]]:
    """Yield (piece, ends_document) as [Note: text pieces] says; the last one ends it."""
    carry = ""
    for text in decoded_chunks(stream, path, chunk_bytes, where):
        carry += text
        if len(carry) < chunk_bytes:
            continue
        cut = _last_cut(carry)
        if cut == 0 and len(carry) >= MAX_CHUNKS * chunk_bytes:
            cut = len(carry)
        if cut:
            yield carry[:cut], False
            carry = carry[cut:]
    yield carry, True


def _last_cut(text: str) -> int:
    """Where the last piece of `text` may end (0: nowhere). The tail is searched first."""
    for start in (max(0, len(text) - _TAIL_CHARS), 0):
        cut = 0
        for match in _CUT.finditer(text, start):
            cut = match.start()
        if cut or start == 0:
            return cut
    return 0
