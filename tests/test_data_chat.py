"""Instruction and chat data: masks checked by hand for `messages` and `prompt`/`completion`,
padding, --overlong, --pack, --train-on-prompt, the cache key, bad records; and through
`infinity train` (RAM and --nvme) the losses of plain PyTorch + AdamW with labels masked by
hand from the same template, with no gradient on the masked positions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_inputs import train_args, write_inputs

from infinity.cli.main import main
from infinity.data import ExampleDataset, ExampleOptions, PackedDataset, open_dataset
from infinity.run.step import causal_lm_loss

# Each message "<s>{role}: {content}</s>"; the generation prompt opens an assistant turn.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
BOS, EOS = 256, 257  # the tiny tokenizer's ids are UTF-8 bytes, <s> = 256, </s> = 257
STEPS, SEQ, MICRO, ACCUM, LR, SEED = 3, 80, 2, 2, 1e-2, 5


def _conversations() -> list[dict]:
    out = []
    for i in range(10):
        msgs = [{"role": "user", "content": f"q{i}?"}, {"role": "assistant", "content": f"a{i}!"}]
        if i % 3 == 0:
            msgs = [{"role": "system", "content": "be brief"}, *msgs]
        if i % 2 == 0:
            msgs += [{"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
        out.append({"messages": msgs})
    return out


def _pairs() -> list[dict]:
    return [{"prompt": f"add {i}+1=", "completion": str(i + 1)} for i in range(10)]


def _by_hand(record: dict) -> tuple[list[int], list[int]]:
    """(ids, mask) of one record as TEMPLATE and the byte tokenizer make them, by hand:
    the mask covers each assistant answer and the </s> closing it, or the completion + EOS."""
    if "prompt" in record:
        prompt, completion = record["prompt"].encode(), record["completion"].encode()
        return [*prompt, *completion, EOS], [0] * len(prompt) + [1] * (len(completion) + 1)
    ids, mask = [], []
    for m in record["messages"]:
        head = [BOS, *f"{m['role']}: ".encode()]
        body = [*m["content"].encode(), EOS]
        ids += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(model dir whose tokenizer has TEMPLATE, chat file, prompt/completion file)."""
    root = tmp_path_factory.mktemp("chat")
    model, _ = write_inputs(root)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    chat, pairs = root / "chat.jsonl", root / "pairs.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in _conversations()))
    pairs.write_text("".join(json.dumps(r) + "\n" for r in _pairs()))
    return model, chat, pairs


def _open(path, model, tmp_path, seq_len=SEQ, **options) -> ExampleDataset:
    return open_dataset(
        path,
        seq_len=seq_len,
        seed=SEED,
        tokenizer_dir=model,
        cache_dir=tmp_path / "cache",
        examples=ExampleOptions(**options),
    )


def _hand_batch(records, indices, seq_len, *, pad=0):
    """(inputs, labels) of `indices` as one padded example per sequence, masked by hand."""
    inputs = torch.full((len(indices), seq_len), pad, dtype=torch.int64)
    labels = torch.full((len(indices), seq_len), -100, dtype=torch.int64)
    for row, i in enumerate(indices):
        ids, mask = _by_hand(records[i])
        ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
        n = len(ids) - 1
        inputs[row, :n] = torch.tensor(ids[:-1])
        labels[row, :n] = torch.tensor(
            [t if m else -100 for t, m in zip(ids[1:], mask[1:], strict=True)]
        )
    return inputs, labels


@pytest.mark.parametrize("which", ["chat", "pairs"])
def test_masks_match_the_hand_made_ones(tmp_path, inputs, which):
    model, chat, pairs = inputs
    path, records = (chat, _conversations()) if which == "chat" else (pairs, _pairs())
    data = _open(path, model, tmp_path)
    assert isinstance(data, ExampleDataset) and data.num_sequences == len(records)
    for i, record in enumerate(records):
        ids, mask = _by_hand(record)
        start, end = data.spans[i]
        assert data.tokens[start:end].tolist() == ids
        assert data.mask[start:end].tolist() == mask
        want_x, want_y = _hand_batch(records, [i], SEQ)
        x, y = data.pair(i)
        assert y.tolist() == want_y[0].tolist()
        assert x[: len(ids) - 1].tolist() == want_x[0, : len(ids) - 1].tolist()
        assert set(x[len(ids) - 1 :].tolist()) <= {EOS}  # padded with EOS, not trained on
    # The template as transformers renders it gives the same ids as the hand-made ones.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    record = _conversations()[0]
    rendered = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=False)
    assert list(rendered) == _by_hand(record)[0]


def test_train_on_prompt_overlong_and_pack(tmp_path, inputs, caplog):
    model, chat, _ = inputs
    records = _conversations()
    longest = max(len(_by_hand(r)[0]) for r in records)
    whole = _open(chat, model, tmp_path, seq_len=longest, train_on_prompt=True)
    for i, record in enumerate(records):
        ids, _ = _by_hand(record)
        assert whole.pair(i)[1][: len(ids) - 1].tolist() == ids[1:]
    short = 45  # cuts the two-answer conversations (54 and 72 tokens)
    over = sum(len(_by_hand(r)[0]) > short + 1 for r in records)
    assert 0 < over < len(records)
    with caplog.at_level("INFO"):
        cut = _open(chat, model, tmp_path, seq_len=short)
        dropped = _open(chat, model, tmp_path, seq_len=short, overlong="drop")
    assert cut.num_sequences == len(records)
    assert (np.diff(cut.spans, axis=1) <= short + 1).all()
    assert dropped.num_sequences == len(records) - over
    assert f"{over} longer than --seq-len {short} + 1 tokens (dropped)" in caplog.text
    assert f"{over} longer than --seq-len {short} + 1 tokens (truncated)" in caplog.text
    # At 28 tokens, a system message pushes the first answer out: no trained token is left.
    with caplog.at_level("INFO"):
        assert _open(chat, model, tmp_path, seq_len=28).num_sequences == len(records) - 4
    assert "4 without a trained token within it (dropped)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        packed = _open(chat, model, tmp_path, seq_len=16, pack=True)
    assert "attend to each other" in caplog.text
    flat_ids, flat_mask = [], []
    for record in records:
        ids, mask = _by_hand(record)
        flat_ids += ids
        flat_mask += mask
    assert packed.num_sequences == (len(flat_ids) - 1) // 16
    x, y = packed.pair(1)
    assert x.tolist() == flat_ids[16:32]
    assert y.tolist() == [
        t if m else -100 for t, m in zip(flat_ids[17:33], flat_mask[17:33], strict=True)
    ]


def test_cache_keys_on_the_template_and_text_data_is_unchanged(tmp_path, inputs):
    model, chat, _ = inputs
    _open(chat, model, tmp_path)
    other = tmp_path / "other.jinja"
    other.write_text(TEMPLATE.replace(": ", ":: "))
    again = _open(chat, model, tmp_path, chat_template=str(other))
    assert len(list((tmp_path / "cache").glob("*.mask"))) == 2
    assert b":: " in bytes(x for x in again.tokens[:40] if x < 256)
    # Pre-training records (a text field) are packed as before, and refuse the SFT flags.
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": "abc " * 20}) + "\n" for _ in range(3)))
    plain = open_dataset(text, seq_len=8, seed=0, tokenizer_dir=model, cache_dir=tmp_path / "c")
    assert type(plain) is PackedDataset
    assert plain.tokens[:5].tolist() == [*b"abc a"]
    with pytest.raises(ValueError, match="--pack"):
        open_dataset(
            text, seq_len=8, seed=0, tokenizer_dir=model, examples=ExampleOptions(pack=True)
        )


@pytest.mark.parametrize(
    "record, needle",
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
        ({"messages": []}, "an empty list"),
        ({"messages": [{"role": "user"}]}, "'role' and 'content'"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
        ({"prompt": "x"}, "first record has"),
        ({"prompt": "x", "completion": 3}, "'completion' is a JSON int"),
    ],
)
def test_bad_records_are_one_clear_error(tmp_path, inputs, record, needle):
    model, chat, pairs = inputs
    first = _conversations()[0] if "messages" in record else _pairs()[0]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match="line 2") as info:
        _open(path, model, tmp_path)
    assert needle in str(info.value)


def test_a_tokenizer_without_a_template_is_an_error_or_takes_a_file(tmp_path, inputs):
    model, chat, _ = inputs
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="has no chat template.*--chat-template"):
        _open(chat, bare, tmp_path)
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    data = _open(chat, bare, tmp_path, chat_template=str(template))
    assert data.tokens[: data.spans[0][1]].tolist() == _by_hand(_conversations()[0])[0]


def test_byte_tokens_take_prompt_completion_but_not_messages(tmp_path, inputs):
    model, chat, pairs = inputs
    data = open_dataset(pairs, seq_len=SEQ, seed=SEED, tokenizer_dir=None, cache_dir=tmp_path)
    ids, mask = _by_hand(_pairs()[3])
    start, end = data.spans[3]
    assert (data.tokens[start:end].tolist(), data.mask[start:end].tolist()) == (ids, mask)
    with pytest.raises(ValueError, match="--byte-tokens"):
        open_dataset(
            chat,
            seq_len=SEQ,
            seed=SEED,
            tokenizer_dir=None,
            cache_dir=tmp_path,
            examples=ExampleOptions(chat_template=str(model / "tokenizer_config.json")),
        )


def test_masked_positions_receive_no_gradient(tmp_path, inputs):
    model, chat, _ = inputs
    from transformers import AutoModelForCausalLM

    data = _open(chat, model, tmp_path)
    x, y = data.next_batch(4)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    logits = net(input_ids=x).logits.detach().requires_grad_(True)
    causal_lm_loss(logits, y).backward()
    per_position = logits.grad.abs().sum(-1)  # (B, L)
    assert (per_position[y == -100] == 0).all()
    assert (per_position[y != -100] > 0).all()
    # And the loss does not see what a masked label would have been.
    noisy = torch.where(y == -100, torch.randint_like(y, 0, 256), y)
    again = causal_lm_loss(logits.detach(), torch.where(y == -100, -100, noisy))
    assert float(again) == float(causal_lm_loss(logits.detach(), y))


def _torch_losses(model_dir: Path, records: list[dict]) -> list[float]:
    """Plain PyTorch + AdamW on the batches `infinity train` draws (the seeded order of the
    examples, re-drawn here), labels masked by hand."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    order = np.random.Generator(np.random.PCG64([SEED, 0])).permutation(len(records)).tolist()
    order += np.random.Generator(np.random.PCG64([SEED, 1])).permutation(len(records)).tolist()
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUM):
            at = (step * ACCUM + micro) * MICRO
            x, y = _hand_batch(records, order[at : at + MICRO], SEQ)
            loss = causal_lm_loss(net(input_ids=x).logits, y)
            (loss / ACCUM).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total / ACCUM)
    return losses


@pytest.mark.parametrize("which", ["chat", "pairs"])
@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_train_matches_torch_with_hand_masked_labels(tmp_path, inputs, which, tier):
    model, chat, pairs = inputs
    path, records = (chat, _conversations()) if which == "chat" else (pairs, _pairs())
    save = tmp_path / "run"
    extra = ["--nvme", str(tmp_path / "swap"), "--placement", "nvme"] if tier == "nvme" else []
    flags = dict(seq_len=SEQ, micro_batch=MICRO, grad_accum=ACCUM, lr=LR, seed=SEED)
    assert main(train_args(model, path, save, "--steps", STEPS, *extra, **flags)) == 0
    lines = (save / "metrics.jsonl").read_text().splitlines()
    got = [json.loads(line)["loss"] for line in lines]
    want = _torch_losses(model, records)
    assert len(got) == STEPS
    assert np.allclose(got, want, rtol=0, atol=1e-5), (got, want)
    assert got[-1] < got[0]


def _tree(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != ".lock"}


def test_cli_refuses_bad_instruction_input_with_one_error(tmp_path, capsys, inputs):
    model, chat, _ = inputs
    save = tmp_path / "run"
    save.mkdir()
    (save / "notes.txt").write_text("kept")
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"text": "abc " * 40}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    cases = [
        (text, ["--pack", "--train-on-prompt"], "--train-on-prompt, --pack shape instruction data"),
        (chat, ["--chat-template", str(tmp_path / "none.jinja")], "no such file"),
        (bad, [], "role 'robot'"),
    ]
    for data, extra, needle in cases:
        before = _tree(save)
        assert main(train_args(model, data, save, "--steps", 1, *extra)) == 1
        err = capsys.readouterr().err
        assert err.count("infinity: error:") == 1 and needle in err, err
        after = {p: b for p, b in _tree(save).items() if "tokens" not in p.parts}
        assert after == {p: b for p, b in before.items() if "tokens" not in p.parts}


def test_resume_of_a_chat_run_gives_the_uninterrupted_losses(tmp_path, capsys, inputs):
    model, chat, _ = inputs
    flags = dict(seq_len=SEQ, micro_batch=MICRO, grad_accum=ACCUM, lr=LR, seed=SEED)
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(train_args(model, chat, whole, "--steps", 4, "--pack", **flags)) == 0
    assert main(train_args(model, chat, part, "--steps", 2, "--pack", **flags)) == 0
    resumed = train_args(model, chat, part, "--steps", 4, "--pack", "--resume", **flags)
    assert main(resumed) == 0

    def losses(save):
        return [
            json.loads(line)["loss"] for line in (save / "metrics.jsonl").read_text().splitlines()
        ]

    assert losses(part) == losses(whole)
    # The examples shaped otherwise do not continue that position.
    unpacked = train_args(model, chat, part, "--steps", 6, "--resume", **flags)
    capsys.readouterr()
    assert main(unpacked) == 1
    assert "resume with the same --pack" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["chat", "pairs"])
def test_an_evaluation_pass_reads_every_example_with_its_masks(tmp_path, inputs, which):
    """--eval-data on instruction data: `sequential_batches` gives each example once, in
    file order, with the same masked labels training uses, and no stream tail."""
    from infinity.data.sequential import sequential_batches

    model, chat, pairs = inputs
    path, records = (chat, _conversations()) if which == "chat" else (pairs, _pairs())
    ds = _open(path, model, tmp_path)
    batches = list(sequential_batches(ds, 2))
    got_inputs = torch.cat([b[0] for b in batches])
    got_labels = torch.cat([b[1] for b in batches])
    want = [ds.pair(i) for i in range(ds.num_sequences)]
    assert got_inputs.shape == (ds.num_sequences, SEQ)
    assert torch.equal(got_inputs, torch.from_numpy(np.stack([w[0] for w in want])))
    assert torch.equal(got_labels, torch.from_numpy(np.stack([w[1] for w in want])))
    assert (got_labels == -100).any() and (got_labels != -100).any()  # masks kept
    assert ds.num_sequences <= len(records)


def test_an_evaluation_pass_of_packed_examples_labels_every_token_once(tmp_path, inputs):
    """Packed, the examples are one stream cut as text is: the pass's labels, in order, are
    the stream's masked next tokens, the tail past the last full sequence included."""
    from infinity.data.sequential import sequential_batches

    model, chat, _ = inputs
    ds = _open(chat, model, tmp_path, pack=True)
    tokens = np.asarray(ds.tokens, dtype=np.int64)
    want = np.where(np.asarray(ds.mask, bool)[1:], tokens[1:], -100)
    got = np.concatenate([b[1].reshape(-1).numpy() for b in sequential_batches(ds, 2)])
    assert len(tokens) - 1 > ds.num_sequences * SEQ  # a tail to read
    assert np.array_equal(got, want)


def test_packed_examples_do_not_attend_to_each_other(tmp_path, inputs):
    """--pack: each example's position ids restart at 0, and with them the model's logits
    for an example inside a packed sequence are those of the example alone (without them,
    the tokens after a boundary see the example before it)."""
    from transformers import AutoModelForCausalLM

    model, chat, _ = inputs
    ds = _open(chat, model, tmp_path, seq_len=48, pack=True)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    checked = 0
    for i in range(ds.num_sequences):
        x = torch.from_numpy(ds.pair(i)[0])
        pos = torch.from_numpy(ds.positions(i * 48, i * 48 + 48))
        starts = torch.nonzero(pos == 0).flatten().tolist()
        if not starts or starts[-1] == 0:
            continue  # no example begins inside this sequence
        b = next(s for s in starts if s > 0)
        e = next((s for s in starts if s > b), 48)
        with torch.no_grad():
            packed = net(input_ids=x[None], position_ids=pos[None], use_cache=False).logits[0]
            alone = net(input_ids=x[None, b:e]).logits[0]
            mixed = net(input_ids=x[None]).logits[0]
        assert torch.allclose(packed[b:e], alone, atol=1e-5)
        assert not torch.allclose(mixed[b:e], alone, atol=1e-3)
        checked += 1
    assert checked


def test_packed_training_matches_torch_with_restarting_positions(tmp_path, inputs):
    """`infinity train --pack` gives, step for step, the losses of plain PyTorch + AdamW fed
    the same packed batches with their position ids."""
    from transformers import AutoModelForCausalLM

    model, chat, _ = inputs
    save = tmp_path / "run"
    flags = dict(seq_len=SEQ, micro_batch=MICRO, grad_accum=ACCUM, lr=LR, seed=SEED)
    assert main(train_args(model, chat, save, "--steps", STEPS, "--pack", **flags)) == 0
    got = [json.loads(x)["loss"] for x in (save / "metrics.jsonl").read_text().splitlines()]
    ds = _open(chat, model, tmp_path, pack=True)
    torch.manual_seed(SEED)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    want = []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(ACCUM):
            x, y, pos = ds.next_batch(MICRO, with_positions=True)
            assert pos is not None and (pos[:, 1:] == 0).any()  # an example begins inside
            loss = causal_lm_loss(net(input_ids=x, position_ids=pos, use_cache=False).logits, y)
            (loss / ACCUM).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        want.append(total / ACCUM)
    assert np.allclose(got, want, rtol=0, atol=1e-5), (got, want)
