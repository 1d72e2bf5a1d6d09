"""`infinity generate`: a save dir (through the engine) and its export (through
transformers) give the same greedy tokens, equal to transformers' own `generate`; sampling
is seeded; chat needs a template; bad flags are clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _train_inputs import train_args, write_inputs

from infinity.cli.generate import ByteTokens, is_export, open_model, sample
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


def test_save_dir_export_and_transformers_generate_the_same_tokens(run, capsys):
    model, save, export = run
    assert is_export(export) and not is_export(save)
    tok = transformers.AutoTokenizer.from_pretrained(export)
    ids = tok(PROMPT)["input_ids"]
    n = 12
    with open_model(export) as logits_of:
        from_export = sample(logits_of, ids, n)
    with open_model(save) as logits_of:
        from_save = sample(logits_of, ids, n)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    out = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        attention_mask=torch.ones(1, len(ids)),
    )
    want = out[0, len(ids) :].tolist()
    assert from_export == from_save == want
    assert len(want) == n
    # Beyond the argmax: the engine's logits over the whole prompt are transformers'.
    seq = torch.tensor([ids])
    with torch.no_grad(), open_model(save) as logits_of:
        engine_logits = logits_of(seq)
        torch.testing.assert_close(engine_logits, hf(input_ids=seq).logits, rtol=1e-5, atol=1e-5)

    text = tok.decode(want, skip_special_tokens=True)
    printed = _gen(capsys, export, "--prompt", PROMPT, "--max-new-tokens", n)
    assert printed == PROMPT + text
    printed = _gen(capsys, save, "--prompt", PROMPT, "--max-new-tokens", n, "--tokenizer", model)
    assert printed == PROMPT + text


def test_sampling_is_seeded_and_top_p_one_token_is_greedy():
    torch.manual_seed(0)
    table = torch.randn(40, 40)

    def logits_of(ids):  # a fixed bigram model: [1, T] -> [1, T, 40]
        return table[ids]

    a = sample(logits_of, [1, 2], 30, temperature=1.0, seed=4)
    assert a == sample(logits_of, [1, 2], 30, temperature=1.0, seed=4)
    assert a != sample(logits_of, [1, 2], 30, temperature=1.0, seed=5)
    greedy = sample(logits_of, [1, 2], 30)
    assert a != greedy
    # A nucleus smaller than the top token's probability holds that token alone: greedy.
    assert sample(logits_of, [1, 2], 30, temperature=1.0, top_p=1e-6, seed=9) == greedy
    # eos ends the sample, and is its last id.
    stop = greedy[3]
    assert sample(logits_of, [1, 2], 30, eos_id=stop)[-1] == stop


def test_chat_uses_the_template(run, tmp_path, capsys):
    _, _, export = run
    chatty = tmp_path / "chatty"
    shutil.copytree(export, chatty)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    (chatty / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = transformers.AutoTokenizer.from_pretrained(chatty)
    ids = tok("<user>hi<assistant>")["input_ids"]
    with open_model(chatty) as logits_of:
        want = tok.decode(sample(logits_of, ids, 5), skip_special_tokens=True)
    assert _gen(capsys, chatty, "--chat", "hi", "--max-new-tokens", 5) == want


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--chat", "hi"], "no chat template"),
        (["--prompt", "x", "--top-p", "0.9"], "--temperature"),
        (["--prompt", "x", "--temperature", "1", "--top-p", "1.5"], "not in (0, 1]"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature -1"),
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
