"""Tiny random Hugging Face causal LMs of several architectures, each saved as a model
directory (save_pretrained) with a small byte-level BPE tokenizer built locally, plus the
plain PyTorch + torch.optim.AdamW reference loop the parity tests compare against."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB = 320
POSITIONS = 64
COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
# Each architecture's config class and its keys besides the vocabulary and the positions.
ARCHS = {
    "llama": ("LlamaConfig", dict(COMMON)),
    "mistral": ("MistralConfig", dict(COMMON, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(COMMON, tie_word_embeddings=True)),
    "gemma": ("GemmaConfig", dict(COMMON, head_dim=8)),
    "phi3": ("Phi3Config", dict(COMMON, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "gpt2": (
        "GPT2Config",
        dict(
            n_embd=32,
            n_layer=2,
            n_head=4,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "qwen3": ("Qwen3Config", dict(COMMON, head_dim=8)),
}


def hf_config(transformers, arch: str, *, vocab: int = VOCAB, **keys):
    """The tiny config of `arch` (a key of ARCHS) with `vocab` tokens (the engine tests'
    batches use fewer); `keys` override any other key of its config class."""
    cls_name, kwargs = ARCHS[arch]
    # max_position_embeddings is GPT2Config's n_positions through its attribute map.
    kwargs = dict(kwargs, vocab_size=vocab, max_position_embeddings=POSITIONS, **keys)
    return getattr(transformers, cls_name)(**kwargs)


def hf_model(transformers, arch: str, *, seed: int = 0, **knobs):
    """A random model of `arch` (transformers' own class), initialized after
    torch.manual_seed(seed); `knobs` as for `hf_config`."""
    config = hf_config(transformers, arch, **knobs)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


CORPUS = [f"document {i}: the quick brown fox {'jumps ' * (i % 5 + 1)}over {i}" for i in range(80)]


def tokenizer(transformers):
    """A byte-level BPE of at most VOCAB tokens trained here, wrapped for save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def write_model_dir(transformers, arch: str, root: Path, *, seed: int = 0) -> Path:
    """`root/arch`: config.json, model.safetensors and the tokenizer files."""
    model = hf_model(transformers, arch, seed=seed)
    with torch.no_grad():  # non-trivial norms, so a swapped name would show
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
    out = root / arch
    model.save_pretrained(out)
    tokenizer(transformers).save_pretrained(out)
    return out


def write_corpus(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    return path


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def reference_losses(model, batches, *, accum, clip, lr, weight_decay, **adamw):
    """Plain PyTorch: AdamW, loss / accum per micro batch, clip_grad_norm_. Returns the mean
    loss and the pre-clip gradient norm of each step, and the trained model. `batches` are
    (input_ids, labels) pairs with labels already shifted."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, **adamw)
    losses, norms = [], []
    for i in range(0, len(batches), accum):
        total = 0.0
        for ids, labels in batches[i : i + accum]:
            loss = causal_lm_loss(model(input_ids=ids).logits, labels)
            (loss / accum).backward()
            total += loss.item() / accum
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, model


def batches(n: int, *, batch: int = 2, seq: int = 12, seed: int = 0):
    """`n` (input_ids, labels) micro batches of token ids below VOCAB."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out
