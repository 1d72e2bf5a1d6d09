"""Supervised fine-tuning data: instruction or chat examples in a memory-mapped cache, batched
one example per sequence (padded) or packed, with the loss on the answers only.

Owns `ExampleOptions` (the flags that shape the examples), the example cache and
`ExampleDataset`; rendering one record is `infinity.data.chat`'s. The cache holds every
example whole: `<key>.tokens` (ids, as the text cache), `<key>.mask` (uint8, 1 where the
token is trained on) and `<key>.starts` (int64, where each example begins, then the end).
Its key covers the data file, the tokenizer, the format, the record kind and the chat
template, i.e. everything that changes those ids and masks; --train-on-prompt, --pack,
--overlong and --seq-len are applied when the cache is read, so one cache serves them all.

    data = open_examples(path, tokenizer, seq_len=..., seed=..., options=ExampleOptions())
    input_ids, labels = data.next_batch(micro_batch)  # labels shifted, -100 off the answers
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infinity.data import chat
from infinity.data.cache import _dtype_for, _open, default_cache_dir
from infinity.data.dataset import PackedDataset
from infinity.data.source import check_data_file, detect_format, iter_records
from infinity.data.tokenizer import Tokenizer
from infinity.utils.fsio import write_file_atomic

log = logging.getLogger(__name__)

IGNORE = -100
OVERLONG = ("truncate", "drop")
_CACHE_VERSION = "sft-v1"


@dataclass(kw_only=True, slots=True)
class ExampleOptions:
    """How instruction and chat records become training sequences."""

    chat_template: str | None = None
    """A Jinja chat template file (--chat-template); None: the tokenizer's own."""
    train_on_prompt: bool = False
    """Take the loss on every token of an example, not only the answers."""
    pack: bool = False
    """Pack several examples per sequence (their positions restart at each example, so the
    model's attention keeps each to itself where its implementation allows)."""
    overlong: str = "truncate"
    """An example longer than a sequence: 'truncate' it or 'drop' it."""

    def __post_init__(self) -> None:
        if self.overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {OVERLONG}, got {self.overlong!r}")

    def is_default(self) -> bool:
        return self == ExampleOptions()


def file_kind(path: str | os.PathLike, fmt: str = "auto") -> str | None:
    """'messages' or 'prompt' when the file's first record is an instruction record; None for
    plain text and for records with a text field (pre-training data)."""
    path = check_data_file(path)
    if detect_format(path, fmt) == "text":
        return None
    for _, record in iter_records(path, fmt=fmt):
        return chat.record_kind(record)
    return None


def open_examples(
    data_path: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    seed: int,
    options: ExampleOptions,
    cache_dir: str | os.PathLike | None = None,
    fmt: str = "auto",
    rank: int = 0,
    world_size: int = 1,
) -> ExampleDataset:
    """An instruction or chat file, tokenized once into the example cache, as a dataset."""
    data_path = check_data_file(data_path)
    kind = file_kind(data_path, fmt)
    if kind is None:
        raise ValueError(
            f"{data_path} holds no instruction records: its first record has neither "
            "'messages' nor 'prompt' and 'completion'"
        )
    template = chat.chat_template_of(tokenizer, options.chat_template) if kind == "messages" else ""
    try:
        cache = build_example_cache(
            data_path, tokenizer, kind, template, cache_dir=cache_dir, fmt=fmt
        )
    except chat.ChatTemplateError as exc:
        source = (
            f"--chat-template {options.chat_template}"
            if options.chat_template is not None
            else f"the chat template of the tokenizer ({getattr(tokenizer, 'name', tokenizer)})"
        )
        raise ValueError(exc.describe(source)) from None
    return ExampleDataset(
        *cache,
        seq_len=seq_len,
        seed=seed,
        options=options,
        pad_id=tokenizer.eos_id or 0,
        rank=rank,
        world_size=world_size,
        source=str(data_path),
    )


def example_cache_key(path: Path, tokenizer: Tokenizer, fmt: str, kind: str, template: str) -> str:
    st = path.stat()
    digest = hashlib.sha256(template.encode()).hexdigest()
    ident = (
        f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{tokenizer.name}|{fmt}|"
        f"{_CACHE_VERSION}|{kind}|{digest}"
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def build_example_cache(data_path, tokenizer, kind, template, *, cache_dir=None, fmt="auto"):
    """(ids, mask, starts) of every example of `data_path`, from the cache or made once."""
    data_path = check_data_file(data_path)
    fmt = detect_format(data_path, fmt)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = example_cache_key(data_path, tokenizer, fmt, kind, template)
    paths = {part: cache_dir / f"{key}.{part}" for part in ("tokens", "mask", "starts", "json")}
    dtype = _dtype_for(tokenizer.vocab_size)
    if not paths["json"].is_file():
        n_tokens, starts = _write_examples(data_path, tokenizer, kind, template, fmt, paths, dtype)
        write_file_atomic(paths["starts"], starts.tobytes())
        meta = {"source": str(data_path), "tokenizer": tokenizer.name, "format": fmt}
        meta |= {"kind": kind, "n_tokens": n_tokens, "n_examples": len(starts) - 1}
        write_file_atomic(paths["json"], json.dumps(meta).encode())  # last: the cache is whole
        log.info("tokenized %s: %d examples, %d tokens", data_path, len(starts) - 1, n_tokens)
    meta = json.loads(paths["json"].read_text())
    n = meta["n_tokens"]
    return (
        _open(paths["tokens"], dtype, n),
        _open(paths["mask"], np.dtype(np.uint8), n),
        np.fromfile(paths["starts"], dtype=np.int64),
    )


def _write_examples(data_path: Path, tokenizer, kind, template, fmt, paths, dtype):
    """Render every record into the ids and mask files as it is read (under temporary names,
    renamed when whole); returns the token count and where each example starts."""
    tmp = {part: paths[part].with_name(f".{paths[part].name}.tmp-{os.getpid()}") for part in paths}
    starts = [0]
    try:
        with open(tmp["tokens"], "wb") as ids_out, open(tmp["mask"], "wb") as mask_out:
            for where, record in iter_records(data_path, fmt=fmt):
                chat.check_record(data_path, where, record, kind)
                if kind == "messages":
                    ids, mask = chat.render_messages(
                        tokenizer, record["messages"], template, f"{data_path} {where}"
                    )
                else:
                    ids, mask = chat.render_prompt(
                        tokenizer, record["prompt"], record["completion"]
                    )
                np.asarray(ids, dtype=dtype).tofile(ids_out)
                mask.astype(np.uint8).tofile(mask_out)
                starts.append(starts[-1] + len(ids))
            for out in (ids_out, mask_out):
                out.flush()
                os.fsync(out.fileno())
        if len(starts) == 1:
            raise ValueError(f"data file {data_path} holds no records; pass a file with examples")
        for part in ("tokens", "mask"):
            os.replace(tmp[part], paths[part])
    finally:
        for part in ("tokens", "mask"):
            if tmp[part].exists():
                tmp[part].unlink()
    return starts[-1], np.asarray(starts, dtype=np.int64)


class ExampleDataset(PackedDataset):
    """Batches of (input_ids, labels) from examples, in a seeded order with a resumable
    position (as `PackedDataset`). Unpacked, sequence i is kept example i: its first L
    tokens as inputs, padded with `pad_id`; labels are the next tokens where they are
    trained on, else (and on the padding) -100. Packed, the kept examples are laid end to
    end and cut as text is."""

    def __init__(self, tokens, mask, starts, *, seq_len, seed, options, pad_id, **kw) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.options = options
        self.pad_id = pad_id
        spans, counts = _kept_spans(mask, starts, seq_len + 1, options)
        self._log_counts(counts, kw.get("source", "data"), seq_len)
        if counts["total"] and not counts["kept"]:
            raise ValueError(_none_kept(counts, kw.get("source", "data"), seq_len, starts))
        self.packed_starts: np.ndarray | None = None
        """Packed: where each kept example begins in `tokens` (see `positions`)."""
        if options.pack:
            tokens, mask = _laid_end_to_end(tokens, mask, spans, starts)
            lengths = spans[:, 1] - spans[:, 0]
            self.packed_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            spans = None
        self.spans = spans
        """(start, end) of each kept example in `tokens` (None: packed, cut as text is)."""
        self.mask = mask
        self.num_examples = counts["kept"]
        super().__init__(tokens, seq_len=seq_len, seed=seed, **kw)

    def _count_sequences(self) -> int:
        return len(self.spans) if self.spans is not None else super()._count_sequences()

    def _too_little(self, source: str) -> str:
        return (
            f"{source} has {self.num_examples} examples with a trained token within --seq-len "
            f"{self.seq_len}, fewer than one sequence needs; raise --seq-len or check the data"
        )

    @staticmethod
    def _log_counts(counts: dict, source: str, seq_len: int) -> None:
        log.info(
            "%s: %d examples, %d trained on; %d longer than --seq-len %d + 1 tokens (%s), "
            "%d without a trained token within it (dropped)",
            source,
            counts["total"],
            counts["kept"],
            counts["overlong"],
            seq_len,
            counts["overlong_action"],
            counts["untrained"],
        )

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence `i`'s (inputs, labels), each (seq_len,): labels[t] is the token after
        inputs[t] where it is trained on, else -100 (as is every padded position)."""
        L = self.seq_len
        if self.spans is None:
            start, end = i * L, i * L + L + 1
        else:
            start, end = (int(x) for x in self.spans[i])
        ids, trained = self._labelled(start, end)
        inputs = np.full(L, self.pad_id, dtype=np.int64)
        labels = np.full(L, IGNORE, dtype=np.int64)
        inputs[: len(ids)], labels[: len(ids)] = ids, trained
        return inputs, labels

    def positions(self, start: int, stop: int) -> np.ndarray | None:
        """Packed: each token's position within its own example, for tokens [start, stop)
        (they restart at 0 where an example begins: with them as `position_ids` the model's
        attention keeps each example to itself, see [Note: packed examples] in
        infinity/data/__init__.py). Unpacked, one example per sequence: None."""
        if self.packed_starts is None:
            return None
        at = np.arange(start, stop, dtype=np.int64)
        first = self.packed_starts[np.searchsorted(self.packed_starts, at, side="right") - 1]
        return at - first

    def tail(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Unpacked, every kept example is a sequence: None. Packed, the tokens past the last
        full sequence, labelled as `pair` labels them (see `PackedDataset.tail`)."""
        start = self.num_sequences * self.seq_len
        if self.spans is not None or len(self.tokens) - start < 2:
            return None
        return self._labelled(start, len(self.tokens))

    def _labelled(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels) of tokens [start, end), unpadded: labels[t] is the token after
        inputs[t] where it is trained on, else -100."""
        ids = np.asarray(self.tokens[start:end], dtype=np.int64)
        if self.options.train_on_prompt:
            keep = np.ones(len(ids), bool)
        else:
            keep = np.asarray(self.mask[start:end], bool)
        return ids[:-1], np.where(keep[1:], ids[1:], IGNORE)

    def state_dict(self) -> dict:
        opts = self.options
        shape = f"pack={opts.pack},overlong={opts.overlong},train_on_prompt={opts.train_on_prompt}"
        return {**super().state_dict(), "examples": shape}

    def load_state_dict(self, d: dict) -> None:
        if d.get("examples") != self.state_dict()["examples"]:
            raise ValueError(
                f"the checkpoint's data position was saved with examples shaped "
                f"{d.get('examples')} but the run now has {self.state_dict()['examples']}; "
                "resume with the same --pack, --overlong and --train-on-prompt"
            )
        super().load_state_dict(d)


def _kept_spans(mask, starts, max_tokens: int, options: ExampleOptions):
    """(start, end) of each example kept, cut to `max_tokens` (or dropped) when longer, and
    the counts the log reports. An example left without a trained label is dropped."""
    begin, end = starts[:-1], starts[1:]
    over = (end - begin) > max_tokens
    keep = ~over if options.overlong == "drop" else np.ones(len(begin), bool)
    cut_end = np.minimum(end, begin + max_tokens) if not options.pack else end
    untrained = 0
    for j in np.flatnonzero(keep):
        lo, hi = int(begin[j]), int(cut_end[j])
        has_label = hi - lo >= 2 and (options.train_on_prompt or mask[lo + 1 : hi].any())
        if not has_label:
            keep[j] = False
            untrained += 1
    counts = {
        "total": len(begin),
        "kept": int(keep.sum()),
        "overlong": int(over.sum()),
        "overlong_action": (
            "dropped"
            if options.overlong == "drop"
            else "kept whole"
            if options.pack
            else "truncated"
        ),
        "untrained": untrained,
    }
    return np.stack([begin[keep], cut_end[keep]], axis=1), counts


def _none_kept(counts: dict, source: str, seq_len: int, starts) -> str:
    """Why no example is left, and the fix."""
    longest = int(np.max(np.diff(starts)))
    why = []
    if counts["overlong"] and counts["overlong_action"] == "dropped":
        why.append(
            f"{counts['overlong']} longer than --seq-len {seq_len} + 1 tokens (--overlong drop;"
            f" the longest has {longest} tokens)"
        )
    if counts["untrained"]:
        why.append(f"{counts['untrained']} without a trained token within --seq-len {seq_len}")
    return (
        f"{source}: all {counts['total']} examples were dropped ({'; '.join(why)}), so there "
        f"is nothing to train on; raise --seq-len (to {longest - 1} keeps every example whole) "
        "or use --overlong truncate"
    )


def _laid_end_to_end(tokens, mask, spans, starts):
    """The kept examples' tokens and masks end to end (the cache itself when all are kept)."""
    if len(spans) == len(starts) - 1:
        return tokens, mask
    pieces = [slice(int(a), int(b)) for a, b in spans]
    return (
        np.concatenate([np.asarray(tokens[p]) for p in pieces]),
        np.concatenate([np.asarray(mask[p]) for p in pieces]),
    )
