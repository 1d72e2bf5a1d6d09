"""Documents from JSON records: JSON lines (one object per line) or one JSON array of objects,
each streamed, with the document's text in one field ("text" by default).

Errors name the file, the line or the array element, and the fix. A JSON array is parsed
element by element from a growing buffer, so a file of any size is never held whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from infinity.data.text import decode, decoded_chunks

# A .json file that is neither JSON lines nor an array: what to do about it.
JSON_ADVICE = (
    'a .json data file must be one JSON array of records ([{"text": "..."}, ...]) or one '
    "record per line (JSON lines); convert any other layout first, e.g. "
    "`jq -c '.data[]' FILE > FILE.jsonl` for records under a key"
)
_SPACE = re.compile(r"\s*")


def iter_json_lines(
    stream: BinaryIO, path: Path, field: str, advice: str
) -> Iterator[tuple[str, bool]]:
    """Yield (text, True) per non-blank line, each line one JSON object."""
    for where, record in iter_line_records(stream, path, advice):
        yield text_of(path, where, record, field, "each line of a JSONL file"), True


def iter_line_records(stream: BinaryIO, path: Path, advice: str) -> Iterator[tuple[str, object]]:
    """Yield (where, value) per non-blank line ("line N"), each line parsed as JSON."""
    offset = 0
    for lineno, raw in enumerate(stream, 1):
        start, offset = offset, offset + len(raw)
        line = decode(path, raw, start).strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path} line {lineno} (byte offset {start}) is not valid JSON: {exc.msg}; {advice}"
            ) from None
        yield f"line {lineno}", record


def iter_json_array(
    stream: BinaryIO, path: Path, field: str, chunk_bytes: int
) -> Iterator[tuple[str, bool]]:
    """Yield (text, True) per element of the one JSON array the file holds."""
    for where, record in iter_array_records(stream, path, chunk_bytes):
        yield text_of(path, where, record, field, "each array element"), True


def iter_array_records(
    stream: BinaryIO, path: Path, chunk_bytes: int
) -> Iterator[tuple[str, object]]:
    """Yield (where, value) per element ("element N") of the one JSON array the file holds."""
    reader = _JsonReader(decoded_chunks(stream, path, chunk_bytes), path)
    reader.expect("[", "the start of the array")
    if reader.peek() == "]":
        reader.take()
    else:
        index = 0
        while True:
            record = reader.value(index)
            yield f"element {index}", record
            index += 1
            sep = reader.take()
            if sep == "]":
                break
            if sep != ",":
                raise reader.error(f"after element {index - 1} comes {sep!r}, not ',' or ']'")
    if reader.peek() != "":
        raise reader.error("there is more after the closing ']'")


class _JsonReader:
    """Decoded text with a read position; filled from `chunks` when a value runs past it."""

    def __init__(self, chunks: Iterator[str], path: Path) -> None:
        self.chunks, self.path = chunks, path
        self.text, self.pos, self.done = "", 0, False
        self.decoder = json.JSONDecoder()

    def _fill(self) -> bool:
        """Double the buffered text (at least one chunk more); False at the end of the file."""
        want = max(1, len(self.text) - self.pos)
        got = []
        while not self.done and sum(map(len, got)) < want:
            chunk = next(self.chunks, None)
            if chunk is None:
                self.done = True
            else:
                got.append(chunk)
        if not got:
            return False
        self.text = self.text[self.pos :] + "".join(got)
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next non-space character ('' at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.text, self.pos).end()
            if self.pos < len(self.text) or not self._fill():
                return self.text[self.pos : self.pos + 1]

    def take(self) -> str:
        char = self.peek()
        self.pos += len(char)
        return char

    def expect(self, char: str, what: str) -> None:
        got = self.take()
        if got != char:
            shown = repr(got) if got else "the end of the file"
            raise self.error(f"expected {what} ({char!r}) but found {shown}")

    def value(self, index: int):
        if self.peek() == "":
            raise self.error(f"the array ends after {index} element(s) without its ']'")
        while True:
            try:
                value, self.pos = self.decoder.raw_decode(self.text, self.pos)
                return value
            except json.JSONDecodeError as exc:
                if not self._fill():
                    raise self.error(f"element {index} is not valid JSON: {exc.msg}") from None

    def error(self, what: str) -> ValueError:
        return ValueError(f"{self.path} is not a JSON array of records: {what}; {JSON_ADVICE}")


def text_of(path: Path, where: str, record, field: str, each: str) -> str:
    """The document text of one record, or an error naming where it is and the fix."""
    if not isinstance(record, dict):
        raise ValueError(
            f"{path} {where} is a JSON {type(record).__name__}, not an object; {each} must "
            f'be one object such as {{"{field}": "..."}}'
        )
    if field not in record:
        raise ValueError(
            f"{path} {where} has no field {field!r} (it has {sorted(record)}); name the "
            "field that holds the text with --data-field NAME"
        )
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(
            f"{path} {where}: field {field!r} is a JSON {type(text).__name__}, not a "
            "string; --data-field must name the field that holds the text"
        )
    return text
