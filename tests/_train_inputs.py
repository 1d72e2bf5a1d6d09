"""The inputs of the `infinity train` tests: a tiny Llama exported as a Hugging Face
directory (with a tokenizer.json that gives the same ids as UTF-8 bytes) and a small JSONL
corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from infinity.models import LlamaConfig, LlamaForCausalLM, export_hf

ROOT = Path(__file__).resolve().parents[1]

TINY = dict(
    vocab_size=260,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    bos_token_id=256,
    eos_token_id=257,
)


# The `infinity train` flags the tests share: steps of 2 micro batches of 2 sequences of 16
# tokens, seeded, without a progress bar.
TRAIN_FLAGS = dict(seq_len=16, micro_batch=2, grad_accum=2, lr=1e-2, seed=5, no_progress=True)


def train_args(model, data, save_dir, *extra, **flags) -> list[str]:
    """`infinity train` of `model` on `data` into `save_dir` with TRAIN_FLAGS, `flags` over
    them (seq_len=32 is --seq-len 32, True a bare flag, None leaves one out), then `extra`
    (where a flag given again wins). With `nvme=`, every class goes to NVMe (--placement
    nvme) unless `placement=` says otherwise: what these tests mean by a run on NVMe."""
    if flags.get("nvme") is not None:
        flags.setdefault("placement", "nvme")
    args = ["train", "--model", str(model), "--data", str(data), "--save-dir", str(save_dir)]
    for name, value in {**TRAIN_FLAGS, **flags}.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not None:
            args += [flag, str(value)]
    return [*args, *map(str, extra)]


def train_process(args: list[str]) -> subprocess.Popen:
    """`python -m infinity.cli.main ARGS` in a child process on the CPU device, its output
    piped as text (for tests that signal or kill a run)."""
    return subprocess.Popen(
        [sys.executable, "-m", "infinity.cli.main", *args],
        env=dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def write_byte_tokenizer(model_dir: Path) -> None:
    """A Hugging Face tokenizer.json whose ids are the UTF-8 bytes (0-255), <s> = 256 and
    </s> = 257: the ids of `ByteTokenizer`, read through transformers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(model_dir / "tokenizer.json"))


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value, as the ByteLevel pre-tokenizer uses."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_inputs(root: Path) -> tuple[Path, Path]:
    """(model directory, corpus.jsonl) under `root`, the same every time."""
    cfg = LlamaConfig(**TINY)
    torch.manual_seed(3)
    export_hf(LlamaForCausalLM(cfg).named_parameters(), cfg, root / "model", dtype="fp32")
    write_byte_tokenizer(root / "model")
    data = root / "corpus.jsonl"
    docs = [{"text": f"doc {i}: " + "abcd" * (i % 9 + 4)} for i in range(120)]
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return root / "model", data
