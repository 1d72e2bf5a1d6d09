"""`infinity generate`: an export gives exactly transformers' own `generate()` tokens,
greedy and seeded sampling; a save dir (through the engine, with the model's KV cache)
gives the same; sampling is seeded; chat needs a template; bad flags are clear errors."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from _hf_models import POSITIONS, write_model_dir
from _train_inputs import train_args, write_inputs

from infinity.cli.generate import ByteTokens, Streamer
from infinity.cli.generate_model import Sampling, decode, is_export, open_model
from infinity.cli.main import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(model dir, save dir after 3 steps, its fp32 export with the tokenizer)."""
    root = tmp_path_factory.mktemp("gen")
    model, data = write_inputs(root)
    save = root / "run"
    assert main(train_args(model, data, save, "--steps", 3)) == 0
    out = root / "export"
    tok = str(model / "tokenizer.json")
    assert (
        main(["export", str(save), "--out", str(out), "--dtype", "fp32", "--copy-files", tok]) == 0
    )
    return model, save, out


PROMPT = "doc 7: abcdab"


def _gen(capsys, *argv) -> str:
    assert main(["generate", *map(str, argv)]) == 0
    return capsys.readouterr().out.rstrip("\n")


def _hf_generate(export, ids, n, sampling: Sampling) -> list[int]:
    """transformers' own `generate()` on the export, seeded as `infinity generate` says."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    options = {"do_sample": False}
    if not sampling.greedy:
        options = dict(do_sample=True, temperature=sampling.temperature,
                       top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0)  # fmt: skip
    torch.manual_seed(sampling.seed)
    seq = torch.tensor([ids])
    out = hf.generate(seq, max_new_tokens=n, attention_mask=torch.ones_like(seq), **options)
    return out[0, len(ids) :].tolist()


SAMPLINGS = [
    Sampling(),
    Sampling(temperature=1.3, seed=3),
    Sampling(temperature=1.5, top_k=20, top_p=0.95, seed=1),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled", "top-k-top-p"])
def test_export_and_save_dir_give_transformers_generate_tokens(run, sampling):
    """Greedy and seeded sampling: the export's tokens are transformers' `generate()`'s,
    and the save dir's (the engine's forward with its KV cache) the same."""
    _, save, export = run
    tok = transformers.AutoTokenizer.from_pretrained(export)
    ids = tok(PROMPT)["input_ids"]
    n = 12
    want = _hf_generate(export, ids, n, sampling)
    assert len(want) == n
    streamed: list[int] = []
    with open_model(export) as model:
        assert model.generate(ids, n, sampling, on_token=streamed.append) == want
    assert streamed == want
    with open_model(save) as model:
        assert model.generate(ids, n, sampling) == want
        assert model.cached  # the prompt once, then one token at a time
    if not sampling.greedy:  # the seed is what makes it so
        with open_model(export) as model:
            other = model.generate(ids, n, Sampling(**{**vars(sampling), "seed": 99}))
        assert other != want


def test_save_dir_export_and_transformers_generate_the_same_text(run, capsys):
    model, save, export = run
    assert is_export(export) and not is_export(save)
    tok = transformers.AutoTokenizer.from_pretrained(export)
    ids = tok(PROMPT)["input_ids"]
    n = 12
    want = _hf_generate(export, ids, n, Sampling())
    # Beyond the argmax: the engine's logits over the whole prompt are transformers'.
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    seq = torch.tensor([ids])
    with torch.no_grad(), open_model(save) as loaded:
        engine_logits, _ = loaded.forward(seq, None)
        torch.testing.assert_close(engine_logits, hf(input_ids=seq).logits, rtol=1e-5, atol=1e-5)

    text = tok.decode(want, skip_special_tokens=True)
    printed = _gen(capsys, export, "--prompt", PROMPT, "--max-new-tokens", n)
    assert printed == PROMPT + text
    printed = _gen(capsys, save, "--prompt", PROMPT, "--max-new-tokens", n, "--tokenizer", model)
    assert printed == PROMPT + text
    flags = ("--max-new-tokens", n, "--temperature", 1.5, "--top-k", 20, "--top-p", 0.95,
             "--seed", 1)  # fmt: skip
    sampled = tok.decode(_hf_generate(export, ids, n, SAMPLINGS[2]), skip_special_tokens=True)
    assert _gen(capsys, export, "--prompt", PROMPT, *flags) == PROMPT + sampled


def _bigram(table):
    """A fixed bigram model as a `Forward` that keeps no cache: [1, t] -> [1, t, vocab]."""

    def forward(ids, cache):
        return table[ids], None

    return forward


def test_sampling_is_seeded_and_top_p_one_token_is_greedy():
    torch.manual_seed(0)
    forward = _bigram(torch.randn(40, 40))

    def sample(n, **kw):
        eos = kw.pop("eos_id", None)
        return decode(forward, [1, 2], n, Sampling(**kw), eos_id=eos)

    a = sample(30, temperature=1.0, seed=4)
    assert a == sample(30, temperature=1.0, seed=4)
    assert a != sample(30, temperature=1.0, seed=5)
    greedy = sample(30)
    assert a != greedy
    # A nucleus smaller than the top token's probability holds that token alone: greedy;
    # so does a top-k of 1.
    assert sample(30, temperature=1.0, top_p=1e-6, seed=9) == greedy
    assert sample(30, temperature=2.0, top_k=1, seed=9) == greedy
    # eos ends the sample, and is its last id.
    stop = greedy[3]
    assert sample(30, eos_id=stop)[-1] == stop


def test_decode_feeds_one_token_at_a_time_where_the_model_keeps_a_cache():
    """With a cache the prompt is fed once, then each new token alone; without one, the
    whole sequence each time. The tokens are the same."""
    table = torch.randn(40, 40, generator=torch.Generator().manual_seed(1))
    fed: dict[bool, list[int]] = {True: [], False: []}

    def forward_with(keeps):
        def forward(ids, cache):
            fed[keeps].append(ids.shape[1])
            return table[ids], ("cache" if keeps else None)

        return forward

    got = [decode(forward_with(k), [1, 2, 3], 5, Sampling(temperature=1.0)) for k in (True, False)]
    assert got[0] == got[1]
    assert fed == {True: [3, 1, 1, 1, 1], False: [3, 4, 5, 6, 7]}


def test_chat_uses_the_template(run, tmp_path, capsys):
    _, _, export = run
    chatty = tmp_path / "chatty"
    shutil.copytree(export, chatty)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    (chatty / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = transformers.AutoTokenizer.from_pretrained(chatty)
    ids = tok("<user>hi<assistant>")["input_ids"]
    with open_model(chatty) as model:
        want = tok.decode(model.generate(ids, 5, Sampling()), skip_special_tokens=True)
    assert _gen(capsys, chatty, "--chat", "hi", "--max-new-tokens", 5) == want


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--chat", "hi"], "no chat template"),
        (["--prompt", "x", "--top-p", "0.9"], "--temperature"),
        (["--prompt", "x", "--temperature", "1", "--top-p", "1.5"], "not in (0, 1]"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature -1"),
        (["--prompt", "x", "--top-k", "5"], "--temperature"),
    ],
)
def test_bad_flags_are_one_error(run, capsys, flags, needle):
    _, _, export = run
    assert main(["generate", str(export), *flags]) == 1
    err = capsys.readouterr().err
    assert needle in err, err


def test_a_missing_directory_is_named(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 1
    assert "nope: no such directory" in capsys.readouterr().err


def test_a_save_dir_keeps_its_runs_tokenizer_and_without_it_asks_for_one(run, capsys, tmp_path):
    model, save, _ = run
    argv = (save, "--prompt", PROMPT, "--max-new-tokens", 4)
    assert _gen(capsys, *argv) == _gen(capsys, *argv, "--tokenizer", model)
    assert (save / "tokenizer" / "tokenizer.json").read_bytes() == (
        model / "tokenizer.json"
    ).read_bytes()
    bare = tmp_path / "bare"  # a save dir from before runs kept their tokenizer
    shutil.copytree(save, bare, ignore=shutil.ignore_patterns("tokenizer"))
    assert main(["generate", str(bare), "--prompt", "x"]) == 1
    assert "--tokenizer DIR" in capsys.readouterr().err
    ids = ByteTokens()("ab")["input_ids"]
    assert ids == [256, 97, 98] and ByteTokens().decode([97, 257]) == "a"


def test_a_lora_checkpoint_asks_for_a_merged_export(run, tmp_path, capsys):
    model, _, _ = run
    data = model.parent / "corpus.jsonl"
    save = tmp_path / "lora"
    assert main(train_args(model, data, save, "--steps", 1, "--lora-r", 2)) == 0
    capsys.readouterr()
    argv = ["generate", str(save), "--prompt", "x", "--tokenizer", str(model)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "LoRA adapters" in err and f"infinity export {save}" in err, err


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(GPT-2 export of POSITIONS learned positions with its tokenizer, a save dir of it)."""
    root = tmp_path_factory.mktemp("gpt2")
    export = write_model_dir(transformers, "gpt2", root)
    _, data = write_inputs(root)
    save = root / "run"
    assert main(train_args(export, data, save, "--steps", 1)) == 0
    return export, save


def _generate(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


@pytest.mark.parametrize("source", ["export", "save_dir"])
def test_generate_stays_within_the_models_positions(gpt2, capsys, caplog, source):
    """GPT-2's learned positions end at POSITIONS: a longer prompt is refused, naming the
    limit; a reply that would run past it is capped there, saying so (it was an IndexError
    from inside the model)."""
    export, save = gpt2
    where = export if source == "export" else save
    tok = transformers.AutoTokenizer.from_pretrained(export)
    code, _, err = _generate(capsys, where, "--tokenizer", export, "--prompt", "ab " * 150)
    assert code == 1
    assert f"takes {POSITIONS} positions" in err
    assert f"shorten the prompt to at most {POSITIONS - 1} tokens" in err

    prompt = "doc 7: abc"
    n_prompt = len(tok(prompt)["input_ids"])
    caplog.set_level(logging.WARNING)
    code, out, err = _generate(
        capsys, where, "--tokenizer", export, "--prompt", prompt, "--max-new-tokens", 100_000
    )
    assert code == 0, err
    room = POSITIONS - n_prompt
    assert f"--max-new-tokens 100000 capped at {room}" in caplog.text
    assert out.startswith(prompt) and len(out.rstrip("\n")) > len(prompt)


def test_a_rotary_models_reply_is_capped_at_its_positions(run, tmp_path, capsys, caplog):
    """Rotary positions run on past the limit (ever slower, the hang of a huge
    --max-new-tokens): the reply is capped at the configured positions too."""
    _, _, export = run
    short = tmp_path / "short"
    shutil.copytree(export, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 24}))
    caplog.set_level(logging.WARNING)
    code, out, err = _generate(capsys, short, "--byte-tokens", "--prompt", "doc 7: abcdab",
                               "--max-new-tokens", 100_000)  # fmt: skip
    assert code == 0, err
    n_prompt = len(ByteTokens()("doc 7: abcdab")["input_ids"])
    assert f"capped at {24 - n_prompt}" in caplog.text


def test_the_reply_is_printed_token_by_token(capsys):
    """Each token is printed (flushed) before the next forward runs; a character whose
    UTF-8 bytes come in two tokens is printed whole once both are there."""
    reply = list("é!".encode())  # 0xC3 0xA9 0x21
    seen: list[str] = []

    def forward(ids, cache):
        seen.append(capsys.readouterr().out)
        out = torch.zeros(1, ids.shape[1], 258)
        out[0, -1, reply[len(seen) - 1] if len(seen) <= len(reply) else 257] = 1.0
        return out, None

    streamer = Streamer(ByteTokens(), "say: ")
    got = decode(forward, [256], 10, Sampling(), eos_id=257, on_token=streamer.add)
    streamer.finish()
    assert got == [*reply, 257]
    assert seen == ["say: ", "", "é", "!"]  # the half character waits for its second byte
    assert capsys.readouterr().out == "\n"


def test_a_live_runs_checkpoint_removed_mid_read_is_read_again(run, tmp_path, capsys, monkeypatch):
    """Retention (--keep-last) removes the checkpoint being read under a live run: the
    newest that is there then is read instead (it was a FileNotFoundError)."""
    import infinity.models.hf_load as hf_load

    model, _, _ = run
    save = tmp_path / "run"
    assert main(train_args(model, model.parent / "corpus.jsonl", save, "--steps", 2,
                           "--save-every", 1)) == 0  # fmt: skip
    argv = [save, "--tokenizer", model, "--prompt", PROMPT, "--max-new-tokens", 6]
    step1 = tmp_path / "step1"
    shutil.copytree(save / "step1", step1)
    _, want, _ = _generate(capsys, step1, *argv[1:])  # what the older checkpoint says

    real_sink, removed = hf_load.copying_sink, []

    def removing_sink(model):
        if not removed:  # the first read: its files go before the weights are read
            removed.append(shutil.move(save / "step2", tmp_path / "gone"))
        return real_sink(model)

    monkeypatch.setattr(hf_load, "copying_sink", removing_sink)
    code, out, err = _generate(capsys, *argv)
    assert code == 0, err
    assert removed and out == want
