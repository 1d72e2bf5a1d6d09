"""Text -> token ids: the model directory's tokenizer when it has one, else UTF-8 bytes.

`load_tokenizer(model_dir)` returns a `Tokenizer`: a HF `tokenizer.json` through the
`tokenizers` package (installed with transformers), or `ByteTokenizer` (256 byte values and
two specials) for presets and directories without a tokenizer. Documents are encoded
without special tokens; the data pipeline appends `eos_id` after each document.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    name: str
    """A fingerprint: token caches are keyed by it."""
    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; BOS = 256, EOS = 257; vocab_size = 258."""

    name = "utf8-bytes-v1"
    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` package."""

    def __init__(self, path: Path, eos_id: int | None) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:
            raise ImportError(
                f"{path} needs the `tokenizers` package to be read; install it "
                "(pip install tokenizers, or pip install 'infinity-trainer[hf]')"
            ) from None
        self._tok = _Tok.from_file(str(path))
        self.name = "hf-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")


def _eos_from_dir(model_dir: Path, tok) -> int | None:
    cfg = model_dir / "config.json"
    if cfg.is_file():
        eos = json.loads(cfg.read_text()).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if isinstance(eos, int):
            return eos
    for name in _EOS_NAMES:
        tid = tok._tok.token_to_id(name)
        if tid is not None:
            return tid
    return None


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """The tokenizer of `model_dir` (its tokenizer.json), or bytes when there is none."""
    if model_dir is None:
        return ByteTokenizer()
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if path.is_file():
        tok = HFTokenizer(path, None)
        tok.eos_id = _eos_from_dir(model_dir, tok)
        return tok
    if (model_dir / "tokenizer.model").is_file():
        raise ValueError(
            f"{model_dir} has a sentencepiece tokenizer.model but no tokenizer.json; convert it "
            "once with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
        )
    return ByteTokenizer()
