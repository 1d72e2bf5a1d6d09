"""Data: tokenizers, token cache, packing, seeded order, exact resume, clear errors."""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest
import torch

from infinity.data import (
    ByteTokenizer,
    PackedDataset,
    build_token_cache,
    load_tokenizer,
    open_dataset,
)


def _jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def test_bytes_tokens_and_eos_per_document(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ["héllo", "", "ab"])
    tokens = build_token_cache(data, ByteTokenizer(), cache_dir=tmp_path / "c")
    eos = ByteTokenizer.eos_id
    assert tokens.tolist() == [*"héllo".encode(), eos, eos, *b"ab", eos]
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16


def test_text_file_is_one_document_streamed_in_chunks(tmp_path, monkeypatch):
    from infinity.data import source

    monkeypatch.setattr(source, "CHUNK_BYTES", 10)
    text = "".join(f"line {i} ✓\n" for i in range(50))
    (tmp_path / "t.txt").write_text(text)
    tokens = build_token_cache(tmp_path / "t.txt", ByteTokenizer(), cache_dir=tmp_path)
    assert tokens.tolist() == [*text.encode(), ByteTokenizer.eos_id]


def test_cache_is_reused_and_rebuilt_when_data_changes(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ["abc"])
    a = build_token_cache(data, ByteTokenizer(), cache_dir=tmp_path / "c")
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    b = build_token_cache(data, ByteTokenizer(), cache_dir=tmp_path / "c")
    assert a.filename == b.filename and sorted(p.name for p in (tmp_path / "c").iterdir()) == files
    _jsonl(data, ["abcdef"])
    c = build_token_cache(data, ByteTokenizer(), cache_dir=tmp_path / "c")
    assert len(c) == 7 and c.filename != a.filename


def _dataset(tmp_path, n_tokens=1001, seq_len=10, seed=3, **kw):
    tokens = np.arange(n_tokens, dtype=np.uint32)
    return PackedDataset(tokens, seq_len=seq_len, seed=seed, **kw)


def test_packing_shift_and_epoch_coverage(tmp_path):
    data = _dataset(tmp_path)
    assert data.num_sequences == 100
    seen = []
    for _ in range(25):  # 100 sequences = one epoch of 25 batches of 4
        x, y = data.next_batch(4)
        assert x.shape == y.shape == (4, 10) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.all(x[:, 0] % 10 == 0)
        seen += (x[:, 0] // 10).tolist()
    assert sorted(seen) == list(range(100)) and seen != list(range(100))
    assert (data.state.epoch, data.state.index) == (1, 0)
    x2, _ = data.next_batch(4)  # epoch 1 has a different order
    assert (x2[:, 0] // 10).tolist() != seen[:4]


def test_same_seed_same_order_other_seed_differs(tmp_path):
    a, b, c = _dataset(tmp_path), _dataset(tmp_path), _dataset(tmp_path, seed=4)
    xa = [a.next_batch(3)[0] for _ in range(5)]
    xb = [b.next_batch(3)[0] for _ in range(5)]
    xc = [c.next_batch(3)[0] for _ in range(5)]
    assert all(torch.equal(p, q) for p, q in zip(xa, xb, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(xa, xc, strict=True))


def test_resume_continues_with_identical_batches_across_epochs(tmp_path):
    ref = _dataset(tmp_path, n_tokens=95)  # 9 sequences: batches of 4 straddle epochs
    run = _dataset(tmp_path, n_tokens=95)
    expect = [ref.next_batch(4) for _ in range(8)]
    for i in range(3):
        assert torch.equal(run.next_batch(4)[0], expect[i][0])
    saved = json.loads(json.dumps(run.state_dict()))
    resumed = _dataset(tmp_path, n_tokens=95)
    resumed.load_state_dict(saved)
    for i in range(3, 8):
        x, y = resumed.next_batch(4)
        assert torch.equal(x, expect[i][0]) and torch.equal(y, expect[i][1])
    other = _dataset(tmp_path, n_tokens=95, seq_len=9)
    with pytest.raises(ValueError, match="seq_len=10 but the data now has seq_len=9"):
        other.load_state_dict(saved)


def test_ranks_split_each_global_batch(tmp_path):
    full = _dataset(tmp_path)
    r0, r1 = (_dataset(tmp_path, rank=r, world_size=2) for r in (0, 1))
    for _ in range(3):
        both = full.next_batch(4)[0]
        assert torch.equal(torch.cat([r0.next_batch(2)[0], r1.next_batch(2)[0]]), both)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_dataset(tmp_path / "none.txt", seq_len=8, seed=0, cache_dir=tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        open_dataset(tmp_path / "empty.txt", seq_len=8, seed=0, cache_dir=tmp_path)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="contains no text"):
        open_dataset(tmp_path / "blank.jsonl", seq_len=8, seed=0, cache_dir=tmp_path)
    (tmp_path / "latin.txt").write_bytes(b"good line\ncaf\xe9 au lait\n")
    with pytest.raises(
        ValueError, match=r"latin.txt is not valid UTF-8: byte 0xe9 at byte offset 13"
    ):
        open_dataset(tmp_path / "latin.txt", seq_len=8, seed=0, cache_dir=tmp_path)
    _jsonl(tmp_path / "f.jsonl", ["a", "b"], field="body")
    with pytest.raises(ValueError, match=r"line 1 has no field 'text' \(it has \['body', 'id'\]\)"):
        open_dataset(tmp_path / "f.jsonl", seq_len=8, seed=0, cache_dir=tmp_path)
    ok = open_dataset(tmp_path / "f.jsonl", seq_len=2, seed=0, cache_dir=tmp_path, field="body")
    assert ok.num_sequences == 1
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(ValueError, match="line 2 .*not valid JSON"):
        open_dataset(tmp_path / "bad.jsonl", seq_len=8, seed=0, cache_dir=tmp_path)
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(
        ValueError, match=r"has 3 tokens, fewer than one sequence needs \(seq_len \+ 1 = 9\)"
    ):
        open_dataset(tmp_path / "short.txt", seq_len=8, seed=0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="data format 'csv'"):
        open_dataset(tmp_path / "f.jsonl", seq_len=8, seed=0, cache_dir=tmp_path, fmt="csv")


def _bpe(corpus):
    """A small byte-level BPE trained on `corpus`, with </s> as a special token."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        special_tokens=["<unk>", "</s>"],
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


CORPUS = ["the cat sat on the mat", "the dog sat on the log"] * 20


def test_model_directory_tokenizer_json(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    tok = _bpe(CORPUS)
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    tok.save(str(model_dir / "tokenizer.json"))
    loaded = load_tokenizer(model_dir)
    assert loaded.eos_id == tok.token_to_id("</s>") and loaded.name.startswith("hf-")
    _jsonl(tmp_path / "d.jsonl", CORPUS[:4])
    data = open_dataset(
        tmp_path / "d.jsonl", tokenizer_dir=model_dir, seq_len=4, seed=0, cache_dir=tmp_path / "c"
    )
    expect = []
    for doc in CORPUS[:4]:
        expect += tok.encode(doc, add_special_tokens=False).ids + [loaded.eos_id]
    assert data.tokens.tolist() == expect
    assert load_tokenizer(None).name == ByteTokenizer.name  # bytes only when asked for


@pytest.mark.parametrize("form", ["vocab+merges+config", "vocab+merges+tokenizer_config"])
def test_other_hugging_face_forms_are_read_not_bytes(tmp_path, form):
    """vocab.json + merges.txt (GPT-2, Qwen) through transformers' own classes."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    tok = _bpe(CORPUS)
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    tok.model.save(str(model_dir))  # vocab.json and merges.txt
    if form == "vocab+merges+config":
        (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    else:
        (model_dir / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "</s>"})
        )
    loaded = load_tokenizer(model_dir)
    text = "the cat sat on the log"
    assert loaded.encode_batch([text]) == [tok.encode(text).ids]
    assert loaded.vocab_size >= tok.get_vocab_size()
    assert loaded.eos_id is not None


def test_sentencepiece_model_is_read_like_sentencepiece_reads_it(tmp_path, caplog):
    """A Llama-style directory with tokenizer.model and tokenizer_config.json only."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")
    pytest.importorskip("google.protobuf", reason="protobuf is not installed")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS + ["a bird in the hand"] * 20),
        model_writer=model,
        vocab_size=60,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "tokenizer.model").write_bytes(model.getvalue())
    (model_dir / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    loaded = load_tokenizer(model_dir)
    reference = spm.SentencePieceProcessor(model_proto=model.getvalue())
    texts = ["the cat sat on the log", "a bird in the mat"]
    assert loaded.encode_batch(texts) == [reference.encode(t) for t in texts]
    assert loaded.eos_id == 2
    assert "copy it there" not in caplog.text
    (model_dir / "tokenizer_config.json").unlink()  # now nothing names the class
    load_tokenizer(model_dir)
    assert "no tokenizer.json or tokenizer_config.json: transformers chose" in caplog.text


def test_token_cache_keys_on_the_tokenizer_used(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    data = _jsonl(tmp_path / "d.jsonl", CORPUS[:6])
    dirs = []
    for i, corpus in enumerate((CORPUS, ["a completely different corpus of words"] * 30)):
        dirs.append(tmp_path / f"t{i}")
        dirs[-1].mkdir()
        _bpe(corpus).save(str(dirs[-1] / "tokenizer.json"))
    cache = tmp_path / "c"
    first, second = (build_token_cache(data, load_tokenizer(d), cache_dir=cache) for d in dirs)
    assert first.tolist() != second.tolist()
    assert len(list(cache.glob("*.tokens"))) == 2
    # The same tokenizer saved again (same pipeline, another mtime) reuses its cache.
    _bpe(CORPUS).save(str(dirs[0] / "tokenizer.json"))
    again = build_token_cache(data, load_tokenizer(dirs[0]), cache_dir=cache)
    assert again.tolist() == first.tolist() and len(list(cache.glob("*.tokens"))) == 2


def test_directory_without_a_tokenizer_is_an_error_not_bytes(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds no tokenizer .*--byte-tokens"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "files, needle",
    [
        ({"tokenizer.json": '{"version": "1.0", "trunc'}, r"tokenizer.json is not valid JSON"),
        ({"tokenizer_config.json": "{,}"}, r"tokenizer_config.json is not valid JSON"),
        ({"tokenizer.json": '{"version": "1.0"}'}, r"\(tokenizer.json\) cannot be read"),
        ({"tokenizer.model": "not a sentencepiece model"}, r"\(tokenizer.model\) cannot be read"),
    ],
)
def test_broken_tokenizer_is_one_error_naming_the_file(tmp_path, files, needle):
    pytest.importorskip("transformers", reason="transformers is not installed")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=needle) as err:
        load_tokenizer(tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


def test_missing_transformers_names_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ImportError, match=r"pip install 'infinity-trainer\[hf\]'"):
        load_tokenizer(tmp_path)


def test_data_path_that_is_not_a_regular_file_says_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    cases = {tmp_path: "is a directory", tmp_path / "pipe": r"is a named pipe \(FIFO\)",
             "/dev/null": "is a character device"}  # fmt: skip
    for path, needle in cases.items():
        with pytest.raises(ValueError, match=needle):
            open_dataset(path, seq_len=8, seed=0, cache_dir=tmp_path / "c")


def test_jsonl_field_errors_name_the_flag(tmp_path):
    (tmp_path / "list.jsonl").write_text('["a", "b"]\n')
    with pytest.raises(ValueError, match="line 1 is a JSON list, not an object"):
        open_dataset(tmp_path / "list.jsonl", seq_len=8, seed=0, cache_dir=tmp_path)
    (tmp_path / "num.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match="'text' is a JSON int, not a string; --data-field"):
        open_dataset(tmp_path / "num.jsonl", seq_len=8, seed=0, cache_dir=tmp_path)
    _jsonl(tmp_path / "f.jsonl", ["a", "b"], field="body")
    with pytest.raises(ValueError, match="--data-field NAME"):
        open_dataset(tmp_path / "f.jsonl", seq_len=8, seed=0, cache_dir=tmp_path)


def test_hf_tokenizer_with_a_whole_number_of_batches(tmp_path):
    """256 documents fill the tokenizing batch exactly: the empty last batch is no error."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    tok_dir = tmp_path / "t"
    tok_dir.mkdir()
    _bpe(CORPUS).save(str(tok_dir / "tokenizer.json"))
    data = _jsonl(tmp_path / "d.jsonl", ["the cat"] * 256)
    tokens = build_token_cache(data, load_tokenizer(tok_dir), cache_dir=tmp_path / "c")
    assert len(tokens) == 256 * (len(_bpe(CORPUS).encode("the cat").ids) + 1)
