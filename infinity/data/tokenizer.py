"""Text -> token ids: a Hugging Face tokenizer from a local directory, or UTF-8 bytes.

`load_tokenizer(dir)` reads any tokenizer transformers can read from a directory (a
tokenizer.json, vocab.json + merges.txt, a sentencepiece model, ...; local files only) and
`load_tokenizer(None)` gives `ByteTokenizer` (256 byte values and two specials). Which one a
run uses is the caller's decision (see `infinity train --byte-tokens`): a directory without
a tokenizer is an error here, never a silent fall back to bytes. Documents are encoded
without special tokens; the data pipeline appends `eos_id` after each document.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

# The files a Hugging Face tokenizer is saved as, in any of its forms.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
    "special_tokens_map.json",
    "added_tokens.json",
)
# Files whose contents must be JSON: checked first, so that a torn download is named.
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "special_tokens_map.json")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
INSTALL_HINT = "pip install 'infinity-trainer[hf]' (or pip install transformers)"


class Tokenizer(Protocol):
    name: str
    """A fingerprint of the tokenization itself: token caches are keyed by it."""
    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; BOS = 256, EOS = 257; vocab_size = 258."""

    name = "utf8-bytes-v1"
    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def describe(self) -> str:
        return "UTF-8 bytes (258 token ids)"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer (`AutoTokenizer`) read from a local directory."""

    def __init__(self, tok, directory: Path, eos_id: int | None) -> None:
        self._tok = tok
        self.directory = directory
        # Long documents are tokenized whole (packing cuts them): no length warning.
        tok.model_max_length = 1 << 62
        self.vocab_size = len(tok)
        self.eos_id = eos_id
        self.name = "hf-" + _fingerprint(tok, directory, eos_id)

    def describe(self) -> str:
        return f"{type(self._tok).__name__} from {self.directory} ({self.vocab_size} token ids)"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:  # transformers cannot encode an empty batch
            return []
        try:
            return self._tok(texts, add_special_tokens=False)["input_ids"]
        except Exception as exc:  # the tokenizers backend raises a bare Exception
            raise ValueError(
                f"the tokenizer {self.describe()} cannot encode the data ({exc}); its files do "
                "not fit its class: use the model's own tokenizer files (or --tokenizer DIR)"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template (None: it has none)."""
        template = getattr(self._tok, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one renders chats
            template = template.get("default")
        return template if isinstance(template, str) else None

    def render_chat(self, messages: list[dict], template: str, *, generation: bool) -> list[int]:
        """The ids of `messages` rendered with the Jinja `template` through transformers'
        apply_chat_template; `generation` adds the template's opening of an assistant turn."""
        return list(
            self._tok.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=True,
                add_generation_prompt=generation,
                return_dict=False,
            )
        )


def _fingerprint(tok, directory: Path, eos_id: int | None) -> str:
    """What decides the ids: the fast tokenizer's whole pipeline when there is one (whatever
    files it came from), else the tokenizer files themselves; plus the class, the EOS and the
    transformers version (its classes add their own steps, which may change between
    versions: a new version tokenizes once more rather than reuse ids it might not give)."""
    import transformers

    ident = f"{type(tok).__name__}|{eos_id}|{transformers.__version__}|"
    h = hashlib.sha256(ident.encode())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        for name in tokenizer_files(directory):
            h.update(name.encode() + b"\0" + (directory / name).read_bytes())
    return h.hexdigest()[:16]


def tokenizer_files(directory: str | Path) -> list[str]:
    """The tokenizer files present in `directory` (empty: it holds no tokenizer)."""
    directory = Path(directory)
    return [name for name in TOKENIZER_FILES if (directory / name).is_file()]


def require_transformers(directory: str | Path) -> None:
    """Raise ImportError naming the package to install when transformers is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ImportError(
            f"the tokenizer in {directory} is read with the transformers package, which is not "
            f"installed; {INSTALL_HINT}"
        ) from None


def _check_json_files(directory: Path) -> None:
    for name in _JSON_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"tokenizer file {path} is not valid JSON ({exc}); it is damaged or incomplete: "
                "download it again"
            ) from None


def _eos_id(directory: Path, tok) -> int | None:
    """The model's end-of-text id: config.json's eos_token_id (the first of a list), else
    the tokenizer's, else a token with one of the usual names."""
    cfg = directory / "config.json"
    if cfg.is_file():
        try:
            eos = json.loads(cfg.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            eos = None  # the model's own loader reports a broken config.json
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if isinstance(eos, int) and not isinstance(eos, bool):
            return eos
    if tok.eos_token_id is not None:
        return tok.eos_token_id
    vocab = tok.get_vocab()  # a bare tokenizer.json does not say which token ends a text
    return next((vocab[name] for name in _EOS_NAMES if name in vocab), None)


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """The tokenizer saved in `directory` (any form transformers reads, local files only),
    or UTF-8 bytes when `directory` is None."""
    if directory is None:
        return ByteTokenizer()
    directory = Path(directory)
    found = tokenizer_files(directory)
    if not found:
        raise ValueError(
            f"{directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:6])}, ...); "
            "copy the model's tokenizer files there, or train on UTF-8 bytes explicitly "
            "(--byte-tokens)"
        )
    _check_json_files(directory)
    require_transformers(directory)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers and tokenizers raise many types; all mean "unreadable"
        why = " ".join(str(exc).split()) or type(exc).__name__
        why = why if len(why) <= 400 else why[:400] + " ..."
        raise ValueError(
            f"the tokenizer in {directory} ({', '.join(found)}) cannot be read: {why.rstrip('.')}. "
            "Download the model's tokenizer files again (tokenizer.json is the most portable "
            "form), or train on UTF-8 bytes explicitly (--byte-tokens)"
        ) from None
    if not {"tokenizer.json", "tokenizer_config.json"} & set(found):
        # Nothing says which tokenizer class applies these files: transformers guesses, and
        # a guessed class can split text differently from the one the model was trained with.
        log.warning(
            "%s has %s but no tokenizer.json or tokenizer_config.json: transformers chose %s "
            "by itself; if the model came with a tokenizer_config.json, copy it there",
            directory,
            ", ".join(found),
            type(tok).__name__,
        )
    return HFTokenizer(tok, directory, _eos_id(directory, tok))
