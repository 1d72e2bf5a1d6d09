"""The tokenizer a training run used, kept in its save dir (`SAVE_DIR/tokenizer/`), so that
`infinity generate SAVE_DIR` reads text as the run did with no flag repeated.

A Hugging Face tokenizer's files are copied there; UTF-8 byte tokens leave a marker file.
Written by rank 0 when the data is read, replaced whole (a new directory renamed into place).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from infinity.data.tokenizer import tokenizer_files

RUN_TOKENIZER = "tokenizer"
BYTES_MARKER = "byte_tokens.json"


def record_tokenizer(save_dir: Path, source: Path | None) -> None:
    """Keep the run's tokenizer (`source`, a directory; None: byte tokens) in `save_dir`."""
    target = save_dir / RUN_TOKENIZER
    fresh = save_dir / f".{RUN_TOKENIZER}.new"
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir()
    if source is None:
        marker = {"tokens": "UTF-8 bytes", "ids": "0-255", "bos_id": 256, "eos_id": 257}
        (fresh / BYTES_MARKER).write_text(json.dumps(marker) + "\n")
    else:
        for name in tokenizer_files(source):
            shutil.copy2(source / name, fresh / name)
    shutil.rmtree(target, ignore_errors=True)
    fresh.rename(target)


def recorded_tokenizer(where: Path) -> Path | None:
    """The tokenizer directory a run left in save dir `where` (or in the save dir holding
    checkpoint directory `where`); None when there is none (a run from before it was kept)."""
    for save_dir in (where, where.parent):
        found = save_dir / RUN_TOKENIZER
        if found.is_dir() and any(found.iterdir()):
            return found
    return None


def is_bytes(recorded: Path) -> bool:
    return (recorded / BYTES_MARKER).is_file()
