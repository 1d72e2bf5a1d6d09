"""Data files beyond one small text: large text in pieces with the ids of the whole text and
a bounded tokenizer batch, .json records, compressed files, --data-field on text."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import random
from pathlib import Path

import pytest
from _train_inputs import train_args, write_inputs

from infinity.cli.main import main
from infinity.data import build_token_cache, load_tokenizer, source
from infinity.data.tokenizer import HFTokenizer

pytestmark = pytest.mark.usefixtures("quiet_root_logger")

_WORDS = ["héllo", "wörld", "naïve", "日本語", "tokens", "  ", "\n", "\n\n", "  indented",
          "x1234", "don't", "😀ok", "end.", "\t"]  # fmt: skip


def _text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(_WORDS) + rng.choice([" ", "", "\n", "  "]) for _ in range(n))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (GPT-2's pre-tokenizer) trained on the test text: multi-byte merges
    that a cut in the wrong place would change."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["</s>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator([_text(3000)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(d)
    return d


@pytest.mark.parametrize("chunk_bytes", [64, 100, 333])
def test_text_pieces_give_the_ids_of_the_whole_text(bpe_dir, tmp_path, monkeypatch, chunk_bytes):
    """Chunks end inside words and multi-byte characters; the pieces are cut where the
    pre-tokenizer splits anyway, so the ids are those of the whole file in one call."""
    monkeypatch.setattr(source, "CHUNK_BYTES", chunk_bytes)
    text = _text(3000, seed=1)
    assert len(text.encode()) > 50 * chunk_bytes
    path = tmp_path / "d.txt"
    path.write_text(text)
    tok = load_tokenizer(bpe_dir)
    whole = tok.encode_batch([text])[0] + [tok.eos_id]
    assert build_token_cache(path, tok, cache_dir=tmp_path / "c").tolist() == whole


def test_text_without_spaces_is_cut_at_characters(tmp_path, monkeypatch):
    from infinity.data import ByteTokenizer

    monkeypatch.setattr(source, "CHUNK_BYTES", 10)
    text = "日本語😀" * 200  # no place to cut but between characters
    (tmp_path / "t.txt").write_text(text)
    tokens = build_token_cache(tmp_path / "t.txt", ByteTokenizer(), cache_dir=tmp_path)
    assert tokens.tolist() == [*text.encode(), ByteTokenizer.eos_id]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("inputs"))


def _train(inputs, data, save_dir, *extra) -> list[str]:
    model, _ = inputs
    return train_args(model, data, save_dir, *extra, steps=1)


def test_a_large_text_reaches_the_tokenizer_in_bounded_batches(inputs, tmp_path, monkeypatch):
    """12 MiB of text on one line (the 2 GB file that aborted in the Rust tokenizer, in
    small): no tokenizer call sees more than a few MiB, and the ids are the bytes."""
    sizes: list[int] = []
    encode = HFTokenizer.encode_batch

    def spy(self, texts):
        sizes.append(sum(map(len, texts)))
        return encode(self, texts)

    monkeypatch.setattr(HFTokenizer, "encode_batch", spy)
    text = ("lorem ipsum dolor sit amet " * 40_000) * 12  # 12.4 MiB, no newline
    data = tmp_path / "big.txt"
    data.write_text(text)
    assert main(_train(inputs, data, tmp_path / "run")) == 0
    assert sum(sizes) == len(text)
    assert max(sizes) <= 6 << 20, sizes  # main: one call with all 12.4 MiB
    tokens = next((tmp_path / "run" / "tokens").glob("*.tokens")).read_bytes()
    assert len(tokens) == 2 * (len(text) + 1)  # uint16 byte ids and the EOS


def _records(inputs) -> list[str]:
    _, data = inputs
    return [json.loads(line)["text"] for line in Path(data).read_text().splitlines()]


def _tokens(run: Path) -> bytes:
    return next((run / "tokens").glob("*.tokens")).read_bytes()


@pytest.mark.parametrize("layout", ["array", "lines"])
def test_a_json_file_is_read_as_records(inputs, tmp_path, layout):
    """A .json file (what `datasets` and export tools write) trains on the records' text,
    the same tokens as the .jsonl it came from, never braces and keys."""
    docs = _records(inputs)
    data = tmp_path / "corpus.json"
    if layout == "array":
        data.write_text(json.dumps([{"text": d, "id": i} for i, d in enumerate(docs)], indent=1))
    else:
        data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert main(_train(inputs, inputs[1], tmp_path / "ref")) == 0
    assert main(_train(inputs, data, tmp_path / "run")) == 0
    assert _tokens(tmp_path / "run") == _tokens(tmp_path / "ref")


@pytest.mark.parametrize(
    "suffix, compress",
    [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)],
)
def test_a_compressed_file_is_read_through_the_standard_library(inputs, tmp_path, suffix, compress):
    data = tmp_path / f"corpus.jsonl{suffix}"
    data.write_bytes(compress(Path(inputs[1]).read_bytes()))
    assert main(_train(inputs, inputs[1], tmp_path / "ref")) == 0
    assert main(_train(inputs, data, tmp_path / "run")) == 0
    assert _tokens(tmp_path / "run") == _tokens(tmp_path / "ref")
