"""The inputs of the `infinity train` tests: a tiny Llama exported as a Hugging Face
directory and a small JSONL corpus."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from infinity.models import LlamaConfig, LlamaForCausalLM, export_hf

TINY = dict(
    vocab_size=260,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def write_inputs(root: Path) -> tuple[Path, Path]:
    """(model directory, corpus.jsonl) under `root`, the same every time."""
    cfg = LlamaConfig(**TINY)
    torch.manual_seed(3)
    export_hf(LlamaForCausalLM(cfg).named_parameters(), cfg, root / "model", dtype="fp32")
    data = root / "corpus.jsonl"
    docs = [{"text": f"doc {i}: " + "abcd" * (i % 9 + 4)} for i in range(120)]
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return root / "model", data
