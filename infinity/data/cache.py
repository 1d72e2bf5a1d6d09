"""The token cache: a data file tokenized once into a flat binary file read by memory map.

`build_token_cache` streams documents through the tokenizer and appends their ids (then
EOS) to `<cache_dir>/<key>.tokens` (uint16 when the vocabulary fits, else uint32), written
under a temporary name and renamed, with a JSON sidecar. The key covers the data file's
path, size and mtime, the tokenizer, the format and, for text, the rule that cuts it into
pieces ([Note: text pieces]), so a changed input rebuilds. Documents go to the tokenizer in
batches of about `BATCH_CHARS`, so its memory stays bounded whatever the file's size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from infinity.data import source
from infinity.data import text as text_pieces
from infinity.data.source import check_data_file, detect_format, iter_documents
from infinity.data.tokenizer import Tokenizer
from infinity.utils.fsio import write_file_atomic

log = logging.getLogger(__name__)

_BATCH_DOCS = 256
BATCH_CHARS = 1 << 20


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "infinity" / "tokens"


def cache_key(path: Path, tokenizer: Tokenizer, fmt: str, field: str, *, legacy=False) -> str:
    """The cache's name; `legacy`: as versions before the text rule was in it named it."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{tokenizer.name}|{fmt}|{field}"
    if fmt == "text" and not legacy:
        ident += f"|{text_rule()}"
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def text_rule() -> str:
    """How a text file is cut into pieces: the rule and the chunk size it cuts at."""
    return f"{text_pieces.RULE}-{source.CHUNK_BYTES}"


def _cached(cache_dir: Path, key: str, dtype: np.dtype) -> np.memmap | None:
    """The complete cache named `key`, if there is one."""
    bin_path, meta_path = cache_dir / f"{key}.tokens", cache_dir / f"{key}.json"
    if meta_path.is_file() and bin_path.is_file():
        meta = json.loads(meta_path.read_text())
        if bin_path.stat().st_size == meta["n_tokens"] * dtype.itemsize:
            return _open(bin_path, dtype, meta["n_tokens"])
    return None


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def build_token_cache(
    data_path: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    cache_dir: str | os.PathLike | None = None,
    fmt: str = "auto",
    field: str = "text",
) -> np.memmap:
    """Tokenize `data_path` once (or reuse the cache) and return the tokens as a memmap."""
    data_path = check_data_file(data_path)
    fmt = detect_format(data_path, fmt)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = cache_key(data_path, tokenizer, fmt, field)
    bin_path, meta_path = cache_dir / f"{key}.tokens", cache_dir / f"{key}.json"
    dtype = _dtype_for(tokenizer.vocab_size)
    # A text cache from before the rule was in the key still serves the run that made it
    # (its resume checks the token count, which a new cut could change).
    for name in (key, cache_key(data_path, tokenizer, fmt, field, legacy=True)):
        found = _cached(cache_dir, name, dtype)
        if found is not None:
            return found
    n_tokens = _write_tokens(data_path, tokenizer, bin_path, dtype, fmt, field)
    meta = {
        "source": str(data_path),
        "tokenizer": tokenizer.name,
        "format": fmt,
        "field": field,
        **({"text_rule": text_rule()} if fmt == "text" else {}),
        "dtype": dtype.name,
        "n_tokens": n_tokens,
    }
    write_file_atomic(meta_path, json.dumps(meta).encode())
    log.info("tokenized %s: %d tokens -> %s", data_path, n_tokens, bin_path)
    return _open(bin_path, dtype, n_tokens)


def _open(path: Path, dtype: np.dtype, n_tokens: int) -> np.memmap:
    if n_tokens == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,))


def _write_tokens(data_path, tokenizer, bin_path: Path, dtype, fmt, field) -> int:
    tmp = bin_path.with_name(f".{bin_path.name}.tmp-{os.getpid()}")
    n_tokens = n_text = 0
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    try:
        with open(tmp, "wb") as out:
            batch: list[tuple[str, bool]] = []
            batch_chars = 0

            def flush() -> int:
                ids: list[int] = []
                for toks, (_, ends) in zip(
                    tokenizer.encode_batch([t for t, _ in batch]), batch, strict=True
                ):
                    ids.extend(toks)
                    if ends:
                        ids.extend(eos)
                np.asarray(ids, dtype=dtype).tofile(out)
                batch.clear()
                return len(ids)

            for text, ends in iter_documents(data_path, fmt=fmt, field=field):
                n_text += len(text.strip()) > 0
                batch.append((text, ends))
                batch_chars += len(text)
                if len(batch) >= _BATCH_DOCS or batch_chars >= BATCH_CHARS:
                    n_tokens += flush()
                    batch_chars = 0
            n_tokens += flush()
            out.flush()
            os.fsync(out.fileno())
        if n_text == 0:
            raise ValueError(f"data file {data_path} contains no text; pass a file with text in it")
        os.replace(tmp, bin_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return n_tokens
